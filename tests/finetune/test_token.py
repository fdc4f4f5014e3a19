"""`lmkit finetune --task token`: word labels on first pieces as transformers' guide aligns them, the built-in
pydocs-ner data, and a tiny BERT that learns to tag (entity F1 as seqeval computes it)."""
from __future__ import annotations

import json
import random

import pytest
import torch

import lmkit
from lmkit.cli import main
from lmkit.finetune.token_classification import encode, read_tagged
from lmkit.objectives import IGNORE_INDEX

transformers = pytest.importorskip("transformers")
FRUIT = ["apple", "pear", "plum", "cherry", "grape", "blueberry", "strawberries"]
TOOLS = ["hammer", "saw", "drill", "wrench", "chisel", "screwdriver"]
FILL = ["the", "a", "big", "small", "old", "new", "red", "blue", "my", "your", "with", "and"]


def tagged(rng: random.Random) -> dict:
    words, tags = [], []
    for _ in range(rng.randint(3, 9)):
        r = rng.random()
        if r < 0.2:
            words.append(rng.choice(FRUIT)), tags.append("B-FRUIT")
        elif r < 0.35:  # a tool, sometimes a two-word one ("drill set")
            words.append(rng.choice(TOOLS)), tags.append("B-TOOL")
            if rng.random() < 0.5:
                words.append("set"), tags.append("I-TOOL")
        else:
            words.append(rng.choice(FILL)), tags.append("O")
    return {"tokens": words, "tags": tags}


@pytest.fixture(scope="module")
def task(tmp_path_factory):
    root = tmp_path_factory.mktemp("ner")
    rng = random.Random(0)
    rows = [tagged(rng) for _ in range(240)]
    tok = lmkit.train_tokenizer([" ".join(r["tokens"]) for r in rows], kind="wordpiece", vocab_size=100)
    cfg = transformers.BertConfig(vocab_size=tok.vocab_size, hidden_size=32, num_hidden_layers=2, num_attention_heads=2,
                                  intermediate_size=48, max_position_embeddings=48)
    torch.manual_seed(0)
    transformers.BertModel(cfg).save_pretrained(root / "base")
    tok.save(root / "base" / "tokenizer.json")
    for name, part in (("train", rows[:200]), ("test", rows[200:])):
        (root / f"{name}.jsonl").write_text("".join(json.dumps(r) + "\n" for r in part), encoding="utf-8")
    return root


def test_labels_sit_on_each_words_first_piece_as_transformers_aligns_them(task):
    """transformers' guide: word_ids() of the fast tokenizer with is_split_into_words, the label on a word's first
    piece, -100 on the rest and on [CLS]/[SEP]; words split into several pieces and cut at max_length included."""
    tok = lmkit.load_tokenizer(task / "base")
    hf = transformers.PreTrainedTokenizerFast(tokenizer_file=str(task / "base" / "tokenizer.json"), cls_token="[CLS]",
                                              sep_token="[SEP]", pad_token="[PAD]", unk_token="[UNK]")
    rng = random.Random(1)
    multi = 0
    for _ in range(40):
        row = tagged(rng)
        tags = [rng.randrange(5) for _ in row["tokens"]]
        for max_length in (64, 9):
            enc = hf(row["tokens"], is_split_into_words=True, truncation=True, max_length=max_length)
            previous, expected = None, []
            for w in enc.word_ids():
                expected.append(IGNORE_INDEX if w is None or w == previous else tags[w])
                previous = w
            ids, labels, firsts = encode(tok, row["tokens"], tags, max_length)
            kept = len(firsts)
            if max_length == 64:
                assert ids == enc["input_ids"] and labels == expected
                multi += len(ids) - 2 > len(row["tokens"])
            else:  # lmkit drops a word that does not fit whole; transformers cuts inside it
                assert ids[:-1] == enc["input_ids"][:len(ids) - 1] and labels[:-1] == expected[:len(ids) - 1]
            assert [labels[p] for p in firsts] == tags[:kept]
    assert multi > 0


def test_pydocs_ner_is_deterministic_and_split_by_document():
    train, val = read_tagged("pydocs-ner"), read_tagged("pydocs-ner", "validation")
    assert train and val and read_tagged("pydocs-ner")[:50] == train[:50]
    assert not {r["doc"] for r in train} & {r["doc"] for r in val}
    tags = {t for r in train for t in r["tags"]}
    assert tags == {"O", "B-MOD", "B-CLS", "B-FUNC"}
    row = next(r for r in train if "json.dumps" in r["tokens"])
    assert row["tags"][row["tokens"].index("json.dumps")] == "B-FUNC"


def test_tiny_bert_learns_to_tag_and_transformers_reads_the_folder(task, tmp_path, capsys):
    out = tmp_path / "run"
    code = main(["finetune", "--task", "token", "--model", str(task / "base"), "--train", str(task / "train.jsonl"),
                 "--eval", str(task / "test.jsonl"), "--out", str(out), "--epochs", "12", "--lr", "5e-3",
                 "--batch-size", "8", "--precision", "fp32"])
    assert code == 0
    best = json.loads(capsys.readouterr().out.strip().splitlines()[-1])
    assert best["f1"] >= 0.9 and best["precision"] >= 0.9 and best["recall"] >= 0.9
    raw = json.loads((out / "config.json").read_text())
    assert raw["architectures"] == ["BertForTokenClassification"]
    assert raw["id2label"] == {"0": "O", "1": "B-FRUIT", "2": "B-TOOL", "3": "I-TOOL"}
    ours, tok = lmkit.load_model(out), lmkit.load_tokenizer(out)
    ref = transformers.BertForTokenClassification.from_pretrained(out).eval()
    ids, _, firsts = encode(tok, ["my", "old", "drill", "set", "and", "a", "plum"], [0] * 7, 32)
    ids = torch.tensor([ids])
    with torch.no_grad():
        torch.testing.assert_close(ours(ids).logits, ref(ids).logits, atol=1e-4, rtol=0)
    assert [ref.config.id2label[i] for i in ref(ids).logits.argmax(-1)[0, [firsts[i] for i in (2, 3, 6)]].tolist()] == \
        ["B-TOOL", "I-TOOL", "B-FRUIT"]
