"""The truncation and padding settings of a tokenizer.json: applied only when asked, and then as `tokenizers`
applies them (strategy, sides, multiple, pad token and type id), the call's arguments overriding them."""
import itertools
import json

import pytest

tokenizers = pytest.importorskip("tokenizers")
from tokenizers import pre_tokenizers as P  # noqa: E402
from tokenizers import processors as R  # noqa: E402

from lmkit.errors import LmkitError  # noqa: E402
from lmkit.tokenizers import load_tokenizer, tokenizer_from_json, train_tokenizer  # noqa: E402

WORDS = ["[UNK]", "[PAD]", "<s>", "</s>", "hello", "world", "a", "b", "c", "d", "e", "f", "!"]
TEXTS = ["hello world a b c d e f", "a", "b c ! d", ""]
PAIRS = ["e f", "hello world a b c d e", "!", "a b"]


def _hf():
    tok = tokenizers.Tokenizer(tokenizers.models.WordLevel({w: i for i, w in enumerate(WORDS)}, unk_token="[UNK]"))
    tok.pre_tokenizer = P.Whitespace()
    tok.post_processor = R.TemplateProcessing(single="<s> $A </s>", pair="<s> $A </s> $B:1 </s>:1",
                                              special_tokens=[("<s>", 2), ("</s>", 3)])
    return tok


def _outputs(encodings):
    return [e.ids for e in encodings], [e.type_ids for e in encodings], [e.attention_mask for e in encodings]


@pytest.mark.parametrize("strategy,direction,side,multiple,fixed", list(itertools.product(
    ["longest_first", "only_first", "only_second"], ["left", "right"], ["left", "right"], [None, 4], [None, 14])))
def test_settings_of_the_file_are_those_of_tokenizers(strategy, direction, side, multiple, fixed):
    hf = _hf()
    hf.enable_truncation(9, strategy=strategy, direction=direction)
    hf.enable_padding(direction=side, pad_id=2, pad_token="<s>", pad_type_id=3, pad_to_multiple_of=multiple,
                      length=fixed)
    ours = tokenizer_from_json(json.loads(hf.to_str()))
    assert ours.pad_token_id == 2  # the file's pad token, not [PAD] found by its name
    padding = "max_length" if fixed else True
    for pairs, add in itertools.product([None, PAIRS], [True, False]):
        try:
            want = _outputs(hf.encode_batch(list(zip(TEXTS, pairs)) if pairs else TEXTS, add_special_tokens=add))
        except Exception:  # a sequence too short for only_first/only_second: lmkit says so too
            with pytest.raises(LmkitError):
                ours(TEXTS, pair=pairs, add_special_tokens=add, padding=padding, truncation=True)
            continue
        got = ours(TEXTS, pair=pairs, add_special_tokens=add, padding=padding, truncation=True)
        assert (got["input_ids"], got["token_type_ids"], got["attention_mask"]) == want
        assert ours.encode_batch(TEXTS, pairs=pairs, add_special_tokens=add, padding=padding, truncation=True) == want[0]
    # only when asked
    assert ours.encode_batch(TEXTS) == [e.ids for e in _plain(hf).encode_batch(TEXTS)]


def _plain(hf):
    hf.no_truncation()
    hf.no_padding()
    return hf


def test_call_arguments_override_the_file():
    hf = _hf()
    hf.enable_truncation(9, direction="left")
    hf.enable_padding(direction="left", pad_id=2, pad_token="<s>", pad_to_multiple_of=4)
    ours = tokenizer_from_json(json.loads(hf.to_str()))
    got = ours(TEXTS, padding=True, truncation=True, max_length=5, pad_to_multiple_of=3, padding_side="right")
    assert got["input_ids"][0] == [2, 9, 10, 11, 3, 2]  # cut on the file's side (left), padded on the call's
    assert got["attention_mask"][1] == [1, 1, 1, 0, 0, 0]
    with pytest.raises(LmkitError, match="padding"):
        ours(TEXTS, padding="both")
    with pytest.raises(LmkitError, match="pair"):
        ours(TEXTS, pair=PAIRS[:2])


def test_roles_survive_added_tokens(tmp_path):
    tok = train_tokenizer(["hello world foo bar"] * 5, kind="word", vocab_size=20, special_tokens=["<blank>", "<q>"])
    tok.save(tmp_path / "tokenizer.json")
    (tmp_path / "special_tokens_map.json").write_text(json.dumps({"pad_token": "<q>"}))
    tok = load_tokenizer(tmp_path)
    assert tok.pad_token_id == 1
    tok.bos_token_id = 0
    new = tok.add_special_tokens(["[MASK]", "[EOS]"])
    assert (tok.pad_token_id, tok.bos_token_id, tok.mask_token_id, tok.eos_token_id) == (1, 0, *new)


def test_a_batch_is_a_list_not_a_string():
    ours = tokenizer_from_json(json.loads(_hf().to_str()))
    with pytest.raises(LmkitError, match="list"):
        ours.encode_batch("hello world")
    with pytest.raises(LmkitError, match="list"):
        ours(["hello", "a b"], pair="ab")
    assert ours("hello", pair="a")["input_ids"] == [2, 4, 3, 6, 3]
