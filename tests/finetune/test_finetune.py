"""`lmkit finetune`: data reading, metrics, and fine-tuning a small random BERT on an easy task."""
from __future__ import annotations

import csv
import json
import random

import pytest
import torch

import lmkit
from lmkit.cli import main
from lmkit.errors import ConfigError, CorpusError
from lmkit.finetune import (FinetuneConfig, accuracy, classifier_from_pretrained, finetune, label_names, macro_f1,
                            read_examples, split_examples)

transformers = pytest.importorskip("transformers")
FRUIT = ["apple", "pear", "plum", "cherry", "grape"]
TOOLS = ["hammer", "saw", "drill", "wrench", "chisel"]
FILL = ["the", "a", "big", "small", "old", "new", "red", "blue", "my", "your"]


def sentence(rng, words):
    return " ".join(rng.choice(FILL) for _ in range(rng.randint(1, 4))) + " " + rng.choice(words) + " " + rng.choice(FILL)


@pytest.fixture(scope="module")
def task(tmp_path_factory):
    """A tiny random BERT with a WordPiece tokenizer, and fruit-vs-tool sentences as JSONL."""
    root = tmp_path_factory.mktemp("ft")
    rng = random.Random(0)
    rows = [{"text": sentence(rng, FRUIT if i % 2 else TOOLS), "label": "fruit" if i % 2 else "tool"} for i in range(160)]
    tok = lmkit.train_tokenizer([r["text"] for r in rows], kind="wordpiece", vocab_size=120)
    cfg = transformers.BertConfig(vocab_size=tok.vocab_size, hidden_size=32, num_hidden_layers=2, num_attention_heads=2,
                                  intermediate_size=48, max_position_embeddings=32)
    torch.manual_seed(0)
    transformers.BertModel(cfg).save_pretrained(root / "base")
    tok.save(root / "base" / "tokenizer.json")
    for name, part in (("train", rows[:120]), ("test", rows[120:])):
        (root / f"{name}.jsonl").write_text("".join(json.dumps(r) + "\n" for r in part), encoding="utf-8")
    return root


def test_finetune_learns_saves_best_and_transformers_loads_it(task, tmp_path):
    out = tmp_path / "run"
    best = finetune(FinetuneConfig(model=str(task / "base"), train=str(task / "train.jsonl"), eval=str(task / "test.jsonl"),
                                   out=str(out), epochs=6, lr=2e-3, batch_size=8, progress=False))
    epochs = [json.loads(line) for line in (out / "metrics.jsonl").read_text().splitlines()]
    assert [e["epoch"] for e in epochs] == [1, 2, 3, 4, 5, 6]  # 6 epochs: every seed 0..5 reaches 1.0 (4: 0.5-1.0)
    assert best["accuracy"] >= 0.9 and best["macro_f1"] >= 0.9
    assert best == max(epochs, key=lambda e: (e["macro_f1"], e["accuracy"]))
    raw = json.loads((out / "config.json").read_text())
    assert raw["architectures"] == ["BertForSequenceClassification"] and raw["id2label"] == {"0": "fruit", "1": "tool"}
    ours = lmkit.load_model(out)
    ref = transformers.BertForSequenceClassification.from_pretrained(out).eval()
    tok = lmkit.load_tokenizer(out)
    enc = tok(["my red cherry the", "a saw old"], padding=True)
    ids, mask = torch.tensor(enc["input_ids"]), torch.tensor(enc["attention_mask"])
    with torch.no_grad():
        torch.testing.assert_close(ours(ids, attention_mask=mask).logits, ref(ids, attention_mask=mask).logits,
                                   atol=1e-4, rtol=0)


def test_cli_with_csv_pairs_and_held_out_split(task, tmp_path, capsys):
    rng = random.Random(1)
    path = tmp_path / "pairs.csv"
    with open(path, "w", newline="", encoding="utf-8") as f:
        w = csv.DictWriter(f, fieldnames=["text", "text_pair", "label"])
        w.writeheader()
        for i in range(40):
            w.writerow({"text": sentence(rng, FRUIT), "text_pair": sentence(rng, FRUIT if i % 2 else TOOLS),
                        "label": i % 2})
    code = main(["finetune", "--model", str(task / "base"), "--train", str(path), "--out", str(tmp_path / "o"),
                 "--epochs", "1", "--val-fraction", "0.25"])
    assert code == 0
    assert "macro-F1" in capsys.readouterr().out
    summary = json.loads((tmp_path / "o" / "finetune.json").read_text())
    assert summary["labels"] == ["0", "1"] and summary["eval_examples"] == 10 and summary["train_examples"] == 30


def test_classifier_keeps_pretrained_body(task):
    base = lmkit.load_model(task / "base")
    model = classifier_from_pretrained(task / "base", 3, pooling="mean")
    for k, v in base.state_dict().items():
        torch.testing.assert_close(model.state_dict()[k], v)  # body and pooler come from the checkpoint
    assert model.classifier.out_features == 3 and model.pooler.pooling == "mean"


def test_metrics():
    pred, gold = [0, 0, 1, 2, 2, 2], [0, 1, 1, 2, 2, 0]
    assert accuracy(pred, gold) == pytest.approx(4 / 6)
    # class 0: tp 1 fp 1 fn 1 -> 0.5; class 1: tp 1 fp 0 fn 1 -> 2/3; class 2: tp 2 fp 1 fn 0 -> 0.8
    assert macro_f1(pred, gold) == pytest.approx((0.5 + 2 / 3 + 0.8) / 3)
    assert macro_f1([1, 1], [1, 1]) == 1.0
    assert macro_f1([0, 0], [1, 1]) == 0.0


def test_data_reading_and_errors(tmp_path):
    good = tmp_path / "d.jsonl"
    good.write_text('{"text": "a", "label": 2}\n\n{"text": "b", "label": 10}\n', encoding="utf-8")
    rows = read_examples(good)
    assert [r.label for r in rows] == ["2", "10"] and label_names(rows) == ["2", "10"]  # numeric order
    bad = tmp_path / "bad.jsonl"
    bad.write_text('{"text": "a"}\n', encoding="utf-8")
    with pytest.raises(CorpusError, match="label"):
        read_examples(bad)
    with pytest.raises(CorpusError):
        read_examples(tmp_path / "missing.csv")
    train, held = split_examples(read_examples(good) * 5, 0.2)
    assert len(held) == 2 and len(train) == 8
    with pytest.raises(ConfigError):
        FinetuneConfig(model="m", train="t", out="o", lr=1.0).check()


def test_finetuned_folder_loads_in_auto_tokenizer(task, tmp_path):
    """A base whose special tokens are not BERT's (a byte-level BPE, as `lmkit train` writes): the fine-tuned
    folder keeps them, so AutoTokenizer gives lmkit's ids instead of failing on BertTokenizer's [UNK]."""
    rows = [json.loads(line) for line in (task / "train.jsonl").read_text().splitlines()]
    tok = lmkit.train_tokenizer([r["text"] for r in rows], kind="bpe", vocab_size=300,
                                special_tokens=["<|endoftext|>", "<|pad|>"])
    cfg = transformers.BertConfig(vocab_size=tok.vocab_size, hidden_size=32, num_hidden_layers=1, num_attention_heads=2,
                                  intermediate_size=48, max_position_embeddings=32, pad_token_id=1)
    torch.manual_seed(0)
    transformers.BertModel(cfg).save_pretrained(tmp_path / "base")
    tok.save_pretrained(tmp_path / "base")
    out = tmp_path / "run"
    finetune(FinetuneConfig(model=str(tmp_path / "base"), train=str(task / "train.jsonl"), out=str(out), epochs=1,
                            batch_size=32, progress=False))
    auto = transformers.AutoTokenizer.from_pretrained(out)
    assert auto.pad_token == "<|pad|>"
    texts = ["my red cherry the", "a saw old"]
    assert auto(texts)["input_ids"] == [lmkit.load_tokenizer(out).encode(t) for t in texts]


@pytest.mark.parametrize("rows, flags, match", [
    ([("pear the", "fruit"), ("saw a", "tool")], [], "too few examples"),  # one example per label: none held out
    ([("pear the", "fruit"), ("plum a", "fruit"), ("saw a", "tool"), ("drill", "tool")], ["--val-fraction", "1"],
     "between 0 and 1"),
])
def test_cli_refuses_a_split_without_training_or_evaluation_rows(task, tmp_path, capsys, rows, flags, match):
    data = tmp_path / "d.csv"
    with data.open("w", newline="", encoding="utf-8") as f:
        csv.writer(f).writerows([("text", "label"), *rows])
    out = tmp_path / "out"
    assert main(["finetune", "--model", str(task / "base"), "--train", str(data), "--out", str(out), *flags]) == 2
    err = capsys.readouterr().err
    assert match in err and "Traceback" not in err and len(err.strip().splitlines()) == 1
    assert not out.exists()


def test_finetune_adds_the_experts_load_balancing_loss(tmp_path):
    """An encoder with experts: the classification step adds router_aux_loss_coef * aux_loss, as the pre-training
    trainers do (it was left out, so the coefficient changed nothing)."""
    from lmkit.config import get_preset
    from lmkit.models import build_model

    rng = random.Random(0)
    rows = [{"text": sentence(rng, FRUIT if i % 2 else TOOLS), "label": "fruit" if i % 2 else "tool"} for i in range(32)]
    (tmp_path / "train.jsonl").write_text("".join(json.dumps(r) + "\n" for r in rows), encoding="utf-8")
    tok = lmkit.train_tokenizer([r["text"] for r in rows], kind="wordpiece", vocab_size=80)
    routers = {}
    for coef in (0.0, 10.0):
        torch.manual_seed(0)
        cfg = get_preset("bert", vocab_size=tok.vocab_size, d_model=16, n_layers=1, n_heads=2, d_ff=24, max_seq_len=32,
                         dropout=0.0, n_experts=4, family=None, router_aux_loss_coef=coef)
        build_model(cfg).save_pretrained(tmp_path / f"base{coef}")
        tok.save(tmp_path / f"base{coef}" / "tokenizer.json")
        finetune(FinetuneConfig(model=str(tmp_path / f"base{coef}"), train=str(tmp_path / "train.jsonl"),
                                eval=str(tmp_path / "train.jsonl"), out=str(tmp_path / f"run{coef}"), epochs=1,
                                lr=1e-3, batch_size=32, progress=False))
        model = lmkit.load_model(tmp_path / f"run{coef}")
        routers[coef] = {n: p for n, p in model.state_dict().items() if "router" in n or "gate" in n}
    assert routers[0.0] and routers[0.0].keys() == routers[10.0].keys()
    assert any(not torch.equal(routers[0.0][n], routers[10.0][n]) for n in routers[0.0])
