"""The folder `lmkit train --objective mlm|mlm-nsp` writes frames a text and a pair as BERT does ([CLS] A [SEP] B [SEP],
segment ids 0/1): the same ids and type ids as transformers' BertTokenizerFast given the run's vocabulary and its
[CLS]/[SEP], through lmkit's tokenizer (what `lmkit finetune` encodes with) and transformers' AutoTokenizer."""
from __future__ import annotations

import json

import pytest

import lmkit
from lmkit.train.config import TrainConfig
from lmkit.train.trainer import Trainer

CORPUS_DOCS = 20  # the corpus_file fixture (conftest.py)
PAIRS = [("def f(x): return x + 1", "Return the sum of its arguments."),
         ("naïve café, 東京 and 🙂 emoji", "x"),
         ("a", "the other side of the pair is longer than this one " * 3),
         ("  spaces  around ", "tabs\tand\nnewlines")]


def bert_reference(out, cls: str, sep: str):
    """transformers' BertTokenizerFast over the run's own pieces (its tokenizer.json without a post-processor)."""
    transformers = pytest.importorskip("transformers")
    tokenizers = pytest.importorskip("tokenizers")
    data = json.loads((out / "tokenizer.json").read_text(encoding="utf-8"))
    data["post_processor"] = None
    backend = tokenizers.Tokenizer.from_str(json.dumps(data))
    return transformers.BertTokenizerFast(tokenizer_object=backend, cls_token=cls, sep_token=sep, pad_token="<|pad|>",
                                          mask_token="<|mask|>", unk_token="<|pad|>")


@pytest.mark.parametrize("objective, sep", [("mlm-nsp", "<|sep|>"), ("mlm", "<|endoftext|>")])
def test_run_folder_encodes_pairs_as_bert_tokenizer_fast(corpus_file, tmp_path, objective, sep):
    transformers = pytest.importorskip("transformers")
    out = tmp_path / objective
    Trainer(TrainConfig(preset="bert-tiny", objective=objective, corpus=[corpus_file], out=str(out), max_steps=1,
                        batch_size=4, seq_len=32, vocab_size=400, precision="fp32", progress=False)).fit()
    ours, auto = lmkit.load_tokenizer(out), transformers.AutoTokenizer.from_pretrained(out)
    bert = bert_reference(out, "<|endoftext|>", sep)
    cls_id, sep_id = ours.token_to_id("<|endoftext|>"), ours.token_to_id(sep)
    assert (ours.cls_token_id, ours.sep_token_id) == (cls_id, sep_id)
    assert (auto.cls_token_id, auto.sep_token_id) == (cls_id, sep_id)
    for a, b in PAIRS:
        want = bert(a, b)
        assert want["input_ids"][0] == cls_id and want["input_ids"][-1] == sep_id and 1 in want["token_type_ids"]
        for got in (ours(a, b), auto(a, b)):
            assert got["input_ids"] == want["input_ids"] and got["token_type_ids"] == want["token_type_ids"]
        assert ours(a)["input_ids"] == bert(a)["input_ids"] == [cls_id, *ours.encode(a, add_special_tokens=False), sep_id]
        cut, ref = ours(a, b, truncation=True, max_length=11), bert(a, b, truncation=True, max_length=11)
        assert (cut["input_ids"], cut["token_type_ids"]) == (ref["input_ids"], ref["token_type_ids"])
    # a batch as `lmkit finetune` encodes it: padded, with segment ids
    texts, pairs = [a for a, _ in PAIRS], [b for _, b in PAIRS]
    got, want = ours(texts, pair=pairs, padding=True), bert(texts, pairs, padding=True)
    assert got["input_ids"] == want["input_ids"] and got["token_type_ids"] == want["token_type_ids"]
    assert got["attention_mask"] == want["attention_mask"]
