"""Seq2SeqLM.generate arguments that the encoder-decoder fuzz (models/test_fuzz_seq2seq.py) found lmkit reading unlike
transformers: each against transformers' generate on the fuzz's T5 v1.1 and BART models."""
import json

import pytest
import torch

import lmkit
from lmkit.errors import GenerationError

transformers = pytest.importorskip("transformers")

from helpers.beams import peaky  # noqa: E402
from helpers.seq2seq_pairs import MODELS  # noqa: E402
from helpers.hub_pairs import saved_pair  # noqa: E402


@pytest.fixture(scope="module", params=[1, 3], ids=["t5-v1.1", "bart"])
def pair(request, tmp_path_factory):
    name, build, scale = MODELS[request.param]
    torch.manual_seed(request.param)
    return saved_pair(peaky(build().eval(), scale), name, tmp_path_factory)


def both(hf, ours, src, seed=0, **kwargs):
    torch.manual_seed(seed)
    expected = hf.generate(src, **kwargs)
    torch.manual_seed(seed)
    return ours.generate(src, **kwargs).tolist(), expected.tolist()


def echoing_source(ours):
    """Sources that end with what the model says when left alone, so that banning their n-grams changes the output."""
    src = torch.tensor([[5, 9, 12, 7], [8, 4, 11, 6]])
    free = ours.generate(src, max_new_tokens=4, eos_token_id=[], forced_eos_token_id=[])
    return torch.cat([src, free[:, 1:]], dim=1), free[:, 1:].tolist()


@pytest.mark.parametrize("mode", [dict(), dict(num_beams=3, num_return_sequences=2),
                                  dict(do_sample=True, top_k=8, num_return_sequences=2)],
                         ids=["greedy", "beams", "sampling"])
def test_encoder_no_repeat_ngram_size_matches_transformers(pair, mode):
    """No n-gram of the source appears in the output (lmkit refused the argument, and ignored it in
    generation_config.json)."""
    hf, ours, _ = pair
    src, free = echoing_source(ours)
    for n in (1, 2):
        got, expected = both(hf, ours, src, max_new_tokens=6, encoder_no_repeat_ngram_size=n, **mode)
        assert got == expected, n
    got, _ = both(hf, ours, src, max_new_tokens=4, encoder_no_repeat_ngram_size=1)
    assert [row[1:] for row in got] != free and not set(got[0][1:]) & set(src[0].tolist())


def with_settings(folder, target, **settings):
    """A copy of the model folder whose generation_config.json also holds `settings`, loaded in lmkit."""
    for name in ("config.json", "model.safetensors", "generation_config.json"):
        (target / name).write_bytes((folder / name).read_bytes())
    raw = json.loads((target / "generation_config.json").read_text())
    (target / "generation_config.json").write_text(json.dumps({**raw, **settings}))
    return lmkit.load_model(target)


def test_encoder_no_repeat_ngram_size_from_generation_config_json(pair, tmp_path):
    hf, _, folder = pair
    ours = with_settings(folder, tmp_path, encoder_no_repeat_ngram_size=2)
    src, _ = echoing_source(ours)
    expected = hf.generate(src, max_new_tokens=6, encoder_no_repeat_ngram_size=2)
    assert ours.generate(src, max_new_tokens=6).tolist() == expected.tolist()
    assert ours.generate(src, max_new_tokens=6, encoder_no_repeat_ngram_size=0).tolist() != expected.tolist()


def test_min_new_tokens_wins_over_a_larger_min_length(pair):
    """transformers sets min_length = min_new_tokens + prompt length whenever min_new_tokens is given, even when
    that is shorter (lmkit held EOS back to the larger of the two)."""
    hf, ours, _ = pair
    src = torch.tensor([[5, 9, 12, 7], [8, 4, 11, 6]])
    free = ours.generate(src, max_new_tokens=8, eos_token_id=[], forced_eos_token_id=[])
    eos = int(free[0, 2])  # row 0's second new token
    for kw in (dict(min_length=8, min_new_tokens=1), dict(min_length=8, min_new_tokens=0), dict(min_length=8),
               dict(min_length=8, min_new_tokens=1, num_beams=2)):
        got, expected = both(hf, ours, src, max_new_tokens=9, eos_token_id=eos, **kw)
        assert got == expected, kw
    got, _ = both(hf, ours, src, max_new_tokens=9, eos_token_id=eos, min_length=8, min_new_tokens=1)
    assert eos in got[0][:4]


@pytest.mark.parametrize("bad,name", [(dict(early_stopping="always"), "early_stopping"),
                                      (dict(forced_eos_token_id=[7, 9], suppress_tokens=[9, 7, 3]), "forced_eos"),
                                      (dict(forced_bos_token_id=7, suppress_tokens=[7]), "forced_bos")])
def test_arguments_transformers_refuses_are_refused(pair, bad, name):
    """lmkit decoded on with these; transformers raises ValueError for each."""
    hf, ours, _ = pair
    src = torch.tensor([[5, 9, 12, 7]])
    with pytest.raises(ValueError):
        hf.generate(src, max_new_tokens=3, **bad)
    with pytest.raises(GenerationError, match=name):
        ours.generate(src, max_new_tokens=3, **bad)


def test_negative_ngram_sizes_are_refused(pair):
    """no_repeat_ngram_size=-1 crashed with an IndexError."""
    _, ours, _ = pair
    for name in ("no_repeat_ngram_size", "encoder_no_repeat_ngram_size"):
        with pytest.raises(GenerationError, match=name):
            ours.generate(torch.tensor([[5, 9, 12, 7]]), max_new_tokens=3, **{name: -1})


def test_generation_config_json_settings_lmkit_lacks_are_refused(pair, tmp_path):
    """A folder asking for a decoding lmkit does not implement (here encoder_repetition_penalty, which changes
    transformers' ids) is refused instead of silently decoded without it; stop_strings from the folder need the
    tokenizer in both libraries."""
    hf, plain, folder = pair
    src, _ = echoing_source(plain)
    ours = with_settings(folder, tmp_path, encoder_repetition_penalty=0.2)
    with_penalty = hf.generate(src, max_new_tokens=6, encoder_repetition_penalty=0.2)
    assert with_penalty.tolist() != hf.generate(src, max_new_tokens=6).tolist()
    with pytest.raises(GenerationError, match="encoder_repetition_penalty"):
        ours.generate(src, max_new_tokens=6)
    ours.generation_defaults.pop("encoder_repetition_penalty")
    assert ours.generate(src, max_new_tokens=6).tolist() == hf.generate(src, max_new_tokens=6).tolist()
    ours = with_settings(folder, tmp_path, stop_strings=["ab"])
    with pytest.raises(ValueError):
        hf.generate(src, max_new_tokens=6, stop_strings=["ab"])
    with pytest.raises(GenerationError, match="tokenizer"):
        ours.generate(src, max_new_tokens=6)


def test_stop_strings_with_beams_are_refused(pair):
    """Beam search ran on past the stop strings, silently (transformers stops hypotheses at them)."""
    _, ours, _ = pair

    class Tok:
        def decode(self, ids, skip_special_tokens=False):
            return " ".join(map(str, ids))

    with pytest.raises(GenerationError, match="beam search"):
        ours.generate(torch.tensor([[5, 9, 12, 7]]), max_new_tokens=3, num_beams=2, stop_strings="1", tokenizer=Tok())
