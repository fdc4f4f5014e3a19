"""DistilBERT on encoders (`lmkit distill` of a masked LM) and head pruning of a fine-tuned encoder classifier
(`lmkit prune --data`)."""
from __future__ import annotations

import json
import random

import pytest
import torch

import lmkit
from lmkit.cli import main
from lmkit.compress.encoders import MaskedDistillation, masked_lm_task
from lmkit.train.config import TrainConfig
from lmkit.train.trainer import Trainer

transformers = pytest.importorskip("transformers")
SMALL = dict(d_model=32, n_layers=4, n_heads=2, d_ff=64, dropout=0.0, attention_dropout=0.0)


@pytest.fixture(scope="module")
def mlm_run(tmp_path_factory, corpus_file):
    out = tmp_path_factory.mktemp("mlm") / "bert"
    Trainer(TrainConfig(preset="bert", objective="mlm", corpus=[corpus_file], out=str(out), max_steps=6, batch_size=8,
                        seq_len=32, lr=3e-3, warmup_steps=1, vocab_size=400, precision="fp32", progress=False,
                        model_overrides=SMALL)).fit()
    return out


def test_masked_distillation_of_a_model_against_itself_leaves_only_the_mlm_loss(mlm_run):
    teacher, tok = lmkit.load_model(mlm_run), lmkit.load_tokenizer(mlm_run)
    task = masked_lm_task(teacher, tok)
    rows = torch.randint(5, teacher.config.vocab_size, (4, 33), generator=torch.Generator().manual_seed(0))
    batch = task.build_batch(rows, 0, torch.Generator().manual_seed(1))
    objective = MaskedDistillation(teacher, task)
    ls, _ = objective.loss(teacher, batch)
    assert int(ls.count) == objective.count(batch) > 0
    assert objective.parts["kl"] == pytest.approx(0, abs=1e-5) and objective.parts["cos"] == pytest.approx(0, abs=1e-5)
    with torch.no_grad():
        ref = teacher(batch["input_ids"], attention_mask=batch["attention_mask"], labels=batch["labels"]).loss
    assert float(ls.sum / ls.count) == pytest.approx(2.0 * float(ref), rel=1e-4)  # alpha = 2 x the masked-LM loss


def test_distill_cli_halves_a_masked_lm_and_transformers_reads_the_student(mlm_run, corpus_file, tmp_path, capsys):
    out = tmp_path / "student"
    assert main(["distill", "--teacher", str(mlm_run), "--out", str(out), "--corpus", corpus_file, "--max-steps", "6",
                 "--batch-size", "8", "--seq-len", "32", "--precision", "fp32"]) == 0
    printed = capsys.readouterr().out
    assert "masked-token accuracy" in printed and "perplexity" not in printed
    report = json.loads((out / "distill.json").read_text())
    assert (report["teacher"]["layers"], report["student"]["layers"]) == (4, 2)
    assert 0 <= report["student"]["masked_accuracy"] <= 1
    rows = [json.loads(line) for line in (out / "metrics.jsonl").read_text().splitlines()]
    assert {"ce", "kl", "cos"} <= set(rows[-1])
    hf = transformers.BertForMaskedLM.from_pretrained(out)
    assert hf.config.num_hidden_layers == 2
    teacher = lmkit.load_model(mlm_run)
    student = lmkit.load_model(out)
    assert student.head == "mlm" and student.num_parameters() < teacher.num_parameters()


def test_prune_removes_the_least_important_heads_of_a_fine_tuned_classifier(tmp_path, capsys):
    from lmkit.finetune import FinetuneConfig, finetune

    rng = random.Random(0)
    words = {"fruit": ["apple", "pear", "plum"], "tool": ["hammer", "saw", "drill"]}
    rows = [{"text": f"{rng.choice(['the', 'my', 'a'])} {rng.choice(words[k])} {rng.choice(['old', 'new'])}",
             "label": k} for k in ("fruit", "tool") * 40]
    tok = lmkit.train_tokenizer([r["text"] for r in rows], kind="wordpiece", vocab_size=60)
    cfg = transformers.BertConfig(vocab_size=tok.vocab_size, hidden_size=32, num_hidden_layers=2, num_attention_heads=4,
                                  intermediate_size=48, max_position_embeddings=32)
    torch.manual_seed(0)
    transformers.BertModel(cfg).save_pretrained(tmp_path / "base")
    tok.save(tmp_path / "base" / "tokenizer.json")
    data = tmp_path / "rows.jsonl"
    data.write_text("".join(json.dumps(r) + "\n" for r in rows), encoding="utf-8")
    finetune(FinetuneConfig(model=str(tmp_path / "base"), train=str(data), eval=str(data), out=str(tmp_path / "clf"),
                            epochs=3, lr=3e-3, batch_size=8, progress=False))
    capsys.readouterr()
    assert main(["prune", "--model", str(tmp_path / "clf"), "--out", str(tmp_path / "pruned"), "--heads", "3",
                 "--data", str(data), "--batches", "4"]) == 0
    report = json.loads((tmp_path / "pruned" / "prune.json").read_text())
    assert report["heads_pruned"] == 3 and report["heads_total"] == 8
    assert report["parameters_after"] < report["parameters_before"]
    assert all(len(v) < 4 for v in report["pruned"].values())  # at least one head kept per layer
    pruned = lmkit.load_model(tmp_path / "pruned")
    assert sum(a.n_heads for a in pruned.modules() if type(a).__name__ == "Attention") == 5
    assert "before accuracy" in capsys.readouterr().out
    assert main(["prune", "--model", str(tmp_path / "clf"), "--out", str(tmp_path / "p2"), "--heads", "1"]) == 2
    assert "pass --data FILE" in capsys.readouterr().err


def test_prune_cuts_rows_to_a_classifier_with_few_positions(tmp_path):
    """A classifier with 8 positions is scored and pruned on rows longer than that (cut, as finetune cuts them)."""
    from lmkit.compress.encoders import prune_classifier
    from lmkit.finetune.classify import classifier_from_pretrained

    texts = [" ".join(["alpha beta gamma delta"] * 4 + [w]) for w in ("one", "two") * 6]
    tok = lmkit.train_tokenizer(texts, kind="wordpiece", vocab_size=40)
    cfg = transformers.BertConfig(vocab_size=tok.vocab_size, hidden_size=16, num_hidden_layers=2,
                                  num_attention_heads=2, intermediate_size=32, max_position_embeddings=8)
    torch.manual_seed(0)
    transformers.BertModel(cfg).save_pretrained(tmp_path / "base")
    tok.save(tmp_path / "base" / "tokenizer.json")
    model = classifier_from_pretrained(tmp_path / "base", 2, id2label={"0": "one", "1": "two"})
    data = tmp_path / "rows.jsonl"
    data.write_text("".join(json.dumps({"text": t, "label": t.split()[-1]}) + "\n" for t in texts), encoding="utf-8")
    report = prune_classifier(model, lmkit.load_tokenizer(tmp_path / "base"), 1, str(data), batches=2, batch_size=4)
    assert report["heads_pruned"] == 1 and report["heads_total"] == 4
    # the label word is past the 8th piece: cut rows of both labels are the same, so one prediction for all
    assert report["before"]["accuracy"] == report["after"]["accuracy"] == 0.5
