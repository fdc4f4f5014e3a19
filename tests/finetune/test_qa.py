"""`lmkit finetune --task qa`: SQuAD v1.1's exact match and F1, windows with a stride and their targets mapped back
to the answer's characters, pydocs-qa, and a tiny BERT that learns to answer."""
from __future__ import annotations

import json
import os
import random
from pathlib import Path

import pytest
import torch

import lmkit
from lmkit.cli import main
from lmkit.finetune.metrics import normalize_answer, squad_f1, squad_scores
from lmkit.finetune.qa import features, read_squad, words

transformers = pytest.importorskip("transformers")
FRUIT = ["apple", "pear", "plum", "cherry", "grape"]
FILL = ["the", "a", "big", "small", "old", "new", "red", "blue", "my", "your", "saw", "with", "and", "tree"]


def test_squad_scores_follow_the_v1_1_script():
    # values worked out from the official script's normalize_answer, f1_score and exact_match_score
    assert normalize_answer("The  Cat, sat!  an apple") == "cat sat apple"
    assert squad_f1("the cat sat", "a cat sat down") == pytest.approx(2 * 1.0 * (2 / 3) / (1 + 2 / 3))
    assert squad_f1("dog", "cat") == 0.0 and squad_f1("", "cat") == 0.0
    scores = squad_scores({"1": "The Denver Broncos", "2": "in 1990", "3": "no"},
                          {"1": ["Denver Broncos", "Broncos"], "2": ["1990s", "in the year 1990"], "3": ["yes"]})
    assert scores["exact_match"] == pytest.approx(100 / 3)
    assert scores["f1"] == pytest.approx(100 * (1 + 2 * 1 * (2 / 3) / (1 + 2 / 3) + 0) / 3)


def test_squad_scores_equal_evaluates_squad_metric_where_it_is_cached():
    """evaluate's "squad" metric is a Hub script (the v1.1 script): compared where it is cached, else skipped."""
    home = Path(os.environ.get("HF_HOME", Path.home() / ".cache" / "huggingface"))
    if not list(home.glob("modules/evaluate_modules/metrics/*squad*")):  # importing evaluate alone takes seconds
        pytest.skip("evaluate's squad metric is not cached here, and loading it needs the Hub")
    try:
        import evaluate

        metric = evaluate.load("squad")
    except Exception:
        pytest.skip("evaluate's squad metric is not available offline here")
    rng = random.Random(0)
    vocab = ["the", "a", "An", "cat", "cat,", "sat", "Sat!", "mat", "on", "1990"]
    preds, refs = [], []
    for i in range(200):
        truths = [" ".join(rng.choice(vocab) for _ in range(rng.randint(1, 5))) for _ in range(rng.randint(1, 3))]
        preds.append({"id": str(i), "prediction_text": " ".join(rng.choice(vocab) for _ in range(rng.randint(0, 5)))})
        refs.append({"id": str(i), "answers": {"text": truths, "answer_start": [0] * len(truths)}})
    ref = metric.compute(predictions=preds, references=refs)
    ours = squad_scores({p["id"]: p["prediction_text"] for p in preds}, {r["id"]: r["answers"]["text"] for r in refs})
    assert ours == pytest.approx(ref)


def qa_row(rng: random.Random, i: int, n: int) -> dict:
    context = [rng.choice(FILL) for _ in range(n)]
    at = rng.randrange(n)
    context[at] = rng.choice(FRUIT)
    text = " ".join(context)
    start = sum(len(w) + 1 for w in context[:at])
    return {"id": str(i), "question": "which fruit is it?", "context": text,
            "answers": {"text": [context[at]], "answer_start": [start]}}


@pytest.fixture(scope="module")
def task(tmp_path_factory):
    root = tmp_path_factory.mktemp("qa")
    rng = random.Random(0)
    rows = [qa_row(rng, i, rng.randint(4, 40)) for i in range(260)]
    tok = lmkit.train_tokenizer([r["question"] + " " + r["context"] for r in rows], kind="wordpiece", vocab_size=100)
    cfg = transformers.BertConfig(vocab_size=tok.vocab_size, hidden_size=32, num_hidden_layers=2, num_attention_heads=2,
                                  intermediate_size=48, max_position_embeddings=48)
    torch.manual_seed(0)
    transformers.BertModel(cfg).save_pretrained(root / "base")
    tok.save(root / "base" / "tokenizer.json")
    for name, part in (("train", rows[:220]), ("test", rows[220:])):
        (root / f"{name}.jsonl").write_text("".join(json.dumps(r) + "\n" for r in part), encoding="utf-8")
    return root


def test_windows_overlap_by_the_stride_and_targets_map_back_to_the_answer(task):
    tok = lmkit.load_tokenizer(task / "base")
    rng = random.Random(5)
    several = 0
    for i in range(60):
        row = qa_row(rng, i, rng.randint(3, 60))
        feats = features(tok, row, i, 24, 6)
        several += len(feats) > 1
        spans = words(row["context"])
        covered, hits = set(), 0
        for a, b in zip(feats, feats[1:]):  # consecutive windows share 6 pieces
            shared = [w for w in a.word_at[-7:-1]]
            assert shared == [w for w in b.word_at if w >= 0][:6]
        for f in feats:
            assert len(f.ids) <= 24 and f.ids[0] == tok.cls_token_id and f.ids[-1] == tok.sep_token_id
            assert f.types == [0] * f.types.index(1) + [1] * (len(f.ids) - f.types.index(1))
            covered |= {w for w in f.word_at if w >= 0}
            if f.start:  # a target: its words spell the answer
                hits += 1
                w0, w1 = f.word_at[f.start], f.word_at[f.end]
                assert row["context"][spans[w0][0]:spans[w1][1]] == row["answers"]["text"][0]
                assert f.start == f.word_at.index(w0)  # the first piece of the answer's word
        assert covered == set(range(len(spans))) and hits >= 1
    assert several > 10


def test_pydocs_qa_answers_are_spans_of_their_context_split_by_document():
    train, val = read_squad("pydocs-qa"), read_squad("pydocs-qa", "validation")
    assert train and val and not {r["doc"] for r in train} & {r["doc"] for r in val}
    for r in train[:500] + val:
        (text,), (start,) = r["answers"]["text"], r["answers"]["answer_start"]
        assert r["context"][start:start + len(text)] == text and r["question"].startswith("What does ")


def test_tiny_bert_learns_to_answer_over_windows_and_transformers_reads_the_folder(task, tmp_path, capsys):
    out = tmp_path / "run"
    code = main(["finetune", "--task", "qa", "--model", str(task / "base"), "--train", str(task / "train.jsonl"),
                 "--eval", str(task / "test.jsonl"), "--out", str(out), "--epochs", "8", "--lr", "5e-3",
                 "--batch-size", "16", "--max-length", "24", "--doc-stride", "8", "--precision", "fp32"])
    assert code == 0
    best = json.loads(capsys.readouterr().out.strip().splitlines()[-1])
    assert best["exact_match"] >= 80 and best["f1"] >= best["exact_match"]
    raw = json.loads((out / "config.json").read_text())
    assert raw["architectures"] == ["BertForQuestionAnswering"]
    ours = lmkit.load_model(out)
    ref = transformers.BertForQuestionAnswering.from_pretrained(out).eval()
    ids = torch.tensor([features(lmkit.load_tokenizer(out), qa_row(random.Random(9), 0, 10), 0, 24, 8)[0].ids])
    with torch.no_grad():
        torch.testing.assert_close(ours(ids).start_logits, ref(ids).start_logits, atol=1e-4, rtol=0)
