"""XLNet's SentencePiece tokenizer: a tiny SentencePiece model trained here, converted by transformers' XLNetTokenizer
(its slow -> fast converter, offline) and saved; lmkit reads the folder with the same ids, pairs
(A <sep> B <sep> <cls>), segment ids (2 for <cls>) and left padding."""
from __future__ import annotations

import random

import pytest

import lmkit

transformers = pytest.importorskip("transformers")
spm = pytest.importorskip("sentencepiece")
pytest.importorskip("google.protobuf")

WORDS = ["hello", "world", "the", "quick", "brown", "fox", "naïve", "café", "北京", "Привет", "don't", "3.14",
         "``quoted''", "Ｆｕｌｌ", "straße", "😀", "e\u0301"]
TEXTS = ["hello world naïve the quick brown fox", "Привет 北京 fox", "the", "``quoted'' don't 3.14 😀",
         "  spaced   out  ", "Ｆｕｌｌ straße e\u0301 café"]
PAIRS = ["quick brown", "don't 3.14", "``quoted'' café", "北京", "the the the the the the", "x"]


@pytest.fixture(scope="module")
def folders(tmp_path_factory):
    tmp = tmp_path_factory.mktemp("xlnet_tok")
    rng = random.Random(0)
    corpus = [" ".join(rng.choice(WORDS) for _ in range(rng.randint(3, 12))) for _ in range(300)]
    (tmp / "spm").mkdir()
    spm.SentencePieceTrainer.train(sentence_iterator=iter(corpus), model_prefix=str(tmp / "spm" / "spiece"),
                                   model_type="unigram", vocab_size=120, hard_vocab_limit=False,
                                   character_coverage=1.0, minloglevel=2, num_threads=1, unk_id=0, bos_id=1,
                                   eos_id=2, pad_id=-1,
                                   control_symbols=["<cls>", "<sep>", "<pad>", "<mask>", "<eod>", "<eop>"])
    ref = transformers.XLNetTokenizer.from_pretrained(tmp / "spm")  # converts spiece.model to tokenizer.json
    ref.save_pretrained(tmp / "hf")
    return ref, tmp / "hf"


def test_ids_pairs_segments_and_left_padding_equal_transformers(folders):
    ref, folder = folders
    ours = lmkit.load_tokenizer(folder)
    assert [ours.encode(t) for t in TEXTS] == [ref.encode(t) for t in TEXTS]
    assert [ours.encode(t, add_special_tokens=False) for t in TEXTS] == \
        [ref.encode(t, add_special_tokens=False) for t in TEXTS]
    for pairs in (None, PAIRS):
        want = ref(TEXTS, pairs, padding=True, return_token_type_ids=True)
        got = ours(TEXTS, pairs, padding=True)
        for key in ("input_ids", "attention_mask", "token_type_ids"):
            assert got[key] == want[key], key
        assert got["attention_mask"][2][0] == 0  # the short row is padded on the left
    one = ours(TEXTS[0], PAIRS[0])
    sep, cls = ref.sep_token_id, ref.cls_token_id
    assert one["input_ids"][-1] == cls and one["token_type_ids"][-1] == 2
    a = len(ref.encode(TEXTS[0], add_special_tokens=False))
    assert one["input_ids"][a] == sep and one["input_ids"][-2] == sep
    assert one["token_type_ids"][:a + 1] == [0] * (a + 1) and set(one["token_type_ids"][a + 1:-1]) == {1}
    assert [ours.decode(ids, skip_special_tokens=True) for ids in got["input_ids"]] == \
        ref.batch_decode(want["input_ids"], skip_special_tokens=True)


def test_saved_folder_keeps_left_padding(folders, tmp_path):
    ref, folder = folders
    ours = lmkit.load_tokenizer(folder)
    ours.save_pretrained(tmp_path)
    again = lmkit.load_tokenizer(tmp_path)
    assert again(TEXTS, padding=True) == ours(TEXTS, padding=True)
    back = transformers.AutoTokenizer.from_pretrained(tmp_path)
    assert back.padding_side == "left"
    assert back(TEXTS, padding=True)["input_ids"] == ours(TEXTS, padding=True)["input_ids"]
    assert ours(TEXTS, padding=True, padding_side="right")["attention_mask"][2][-1] == 0  # the call still wins
