"""`--pattern code`: byte-level BPE whose pre-tokenizer cuts runs of spaces and tabs out whole. The tokenizer
trained on pycode equals `tokenizers`' BpeTrainer on the same pipeline, and its saved tokenizer.json encodes
exactly as `tokenizers` and transformers read it."""
import json

import pytest

tokenizers = pytest.importorskip("tokenizers")
from tokenizers import decoders, models, pre_tokenizers, trainers  # noqa: E402

from lmkit.data.corpus import load_corpus  # noqa: E402
from lmkit.tokenizers import load_tokenizer, train_tokenizer  # noqa: E402
from lmkit.tokenizers.pre_tokenizers import CODE_WHITESPACE  # noqa: E402

ODD = ["def f(x):\n\tif x:\n\t\treturn  x  \n", "  \t  mixed\t\t \nindent", "    ünïcode = 'café'  # ✓ \r\n",
       "x=1;\n\n\n        y = [1,\n                 2]", " ", "\t", "a  b   c    d", ""]


@pytest.fixture(scope="module")
def pycode():
    train, held = load_corpus(["pycode"]).split(0.05)
    return train.texts()[:80], held.texts()[:8]


def _hf_code_bpe(texts, size, specials):
    tok = tokenizers.Tokenizer(models.BPE())
    tok.pre_tokenizer = pre_tokenizers.Sequence([
        pre_tokenizers.Split(tokenizers.Regex(CODE_WHITESPACE), "isolated"),
        pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=True)])
    tok.decoder = decoders.ByteLevel()
    tok.train_from_iterator(texts, trainers.BpeTrainer(vocab_size=size, special_tokens=specials, show_progress=False,
                                                       initial_alphabet=pre_tokenizers.ByteLevel.alphabet()))
    return tok


def test_runs_of_spaces_and_tabs_are_pieces_of_their_own():
    tok = train_tokenizer(["    return x\n\t\tpass"] * 20, "bpe", 300, pattern="code")
    words = tok.pre_tokenizer.split("\n        return  x\t\ty")
    assert words == ["Ċ", "ĠĠĠĠĠĠĠĠ", "return", "ĠĠ", "x", "ĉĉ", "y"]
    assert "ĠĠĠĠ" in tok.get_vocab()  # indentation, learned whole


def test_the_code_tokenizer_equals_tokenizers_own_training_and_reads_back(pycode, tmp_path):
    transformers = pytest.importorskip("transformers")
    train, held = pycode
    ours = train_tokenizer(train, "bpe", 600, pattern="code")
    hf = _hf_code_bpe(train, 600, ["<|endoftext|>", "<|pad|>"])
    theirs = json.loads(hf.to_str())["model"]
    assert ours.model.vocab == theirs["vocab"]
    assert [list(m) for m in ours.model.merges] == [list(m) for m in theirs["merges"]]
    path = ours.save(tmp_path / "tokenizer.json")
    loaded = tokenizers.Tokenizer.from_file(path)
    fast = transformers.PreTrainedTokenizerFast(tokenizer_file=path)
    again = load_tokenizer(path)
    for text in held + ODD:
        ids = ours.encode(text, add_special_tokens=False)
        assert ids == loaded.encode(text, add_special_tokens=False).ids == hf.encode(text).ids, text
        assert ids == fast(text, add_special_tokens=False)["input_ids"] == again.encode(text, add_special_tokens=False)
        assert ours.decode(ids) == loaded.decode(ids) == text  # lossless, whitespace included
