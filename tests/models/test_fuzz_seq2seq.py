"""Hypothesis fuzzing of `Seq2SeqLM.generate` against transformers' `generate` on T5 (v1.0 relu, v1.1 gated-gelu,
tied and untied) and BART models of odd sizes: the same ids for batched, padded sources under every argument,
seeded sampling included (one torch.multinomial per step over the batch, as transformers draws), the same
scores with return_dict_in_generate, a refusal where transformers refuses, and the same defaults read from a
folder's generation_config.json.

S2S_FUZZ_EXAMPLES raises the number of argument sets (the audit ran thousands; the suite runs a few dozen).
"""
import os
import warnings

import pytest
import torch
from hypothesis import HealthCheck, given, note, settings, strategies as st

import lmkit
from lmkit.errors import LmkitError

transformers = pytest.importorskip("transformers")
transformers.logging.set_verbosity_error()

from helpers.beams import peaky  # noqa: E402
from helpers.hub_pairs import saved_pair  # noqa: E402
from helpers.seq2seq_pairs import MODELS  # noqa: E402

def fuzz_settings(variable: str) -> tuple[int, settings]:
    """(examples, hypothesis settings): a few dozen derandomized examples, or $variable of them (random past 100)."""
    examples = int(os.environ.get(variable, "40"))
    return examples, settings(max_examples=examples, deadline=None, derandomize=examples <= 100,
                              suppress_health_check=[HealthCheck.too_slow, HealthCheck.function_scoped_fixture,
                                                     HealthCheck.data_too_large])


EXAMPLES, FUZZ = fuzz_settings("S2S_FUZZ_EXAMPLES")


class Pairs(list):
    """(transformers model, lmkit model, folder) per entry of a MODELS list, shown by name in hypothesis' reports."""

    def __init__(self, models, tmp_path_factory):
        super().__init__()
        self.names = [name for name, _, _ in models]
        for i, (name, build, scale) in enumerate(models):
            torch.manual_seed(i)
            self.append(saved_pair(peaky(build().eval(), scale), name, tmp_path_factory))

    def __repr__(self):
        return f"Pairs({self.names})"


@pytest.fixture(scope="module")
def pairs(tmp_path_factory):
    return Pairs(MODELS, tmp_path_factory)


def sources(draw, vocab, pad):
    """A batch of padded sources (each row at least one real token, padding on the right or left) and its
    attention mask, or None: transformers does not infer an encoder-decoder's mask from the pad tokens."""
    rows, length = draw(st.integers(1, 3)), draw(st.integers(2, 9))
    ids = torch.tensor(draw(st.lists(st.lists(st.integers(3, vocab - 1), min_size=length, max_size=length),
                                     min_size=rows, max_size=rows)))
    lengths = torch.tensor(draw(st.lists(st.integers(1, length), min_size=rows, max_size=rows)))[:, None]
    mask = (torch.arange(length)[None] < lengths).long()
    if draw(st.booleans()):
        mask = mask.flip(1)
    ids = ids.masked_fill(mask == 0, pad)
    return ids, None if draw(st.integers(0, 5)) == 0 else mask


# a value transformers refuses (or lmkit refuses as its documented stricter check) for each argument
INVALID = {"temperature": [0.0, -0.5], "top_p": [0.0, 1.5], "top_k": [-1], "min_p": [1.5, -0.1], "typical_p": [0.0, 2.0],
           "epsilon_cutoff": [1.0, -0.1], "eta_cutoff": [1.0, -0.1], "repetition_penalty": [0.0, -1.0],
           "num_beams": [0], "num_return_sequences": [0, 9], "max_new_tokens": [-1], "max_length": [1],
           "bad_words_ids": [[[]], [3, 4], [[-1]]], "encoder_no_repeat_ngram_size": [-1, 1.5],
           "no_repeat_ngram_size": [-1], "early_stopping": ["always"], "num_beam_groups": [2], "diversity_penalty": [0.5]}


def generate_kwargs(draw, vocab, rows, tokens, valid=False):
    """(one argument set, the name of its invalid argument or None); `tokens` are ids the model emits when left
    alone, so EOS and bans take effect. Now and then (not when `valid`) one argument gets an invalid value."""
    token = st.sampled_from(tokens)
    mode = draw(st.sampled_from(["greedy", "sample", "beams", "beam-sample"]))
    kw = {"do_sample": mode in ("sample", "beam-sample")}
    if mode in ("beams", "beam-sample"):
        kw["num_beams"] = draw(st.integers(2, 4))
        kw["length_penalty"] = draw(st.sampled_from([1.0, 0.5, 2.0, -1.0, 0.0]))
        kw["early_stopping"] = draw(st.sampled_from([False, True, "never"]))
        kw["num_return_sequences"] = draw(st.integers(1, kw["num_beams"]))
    elif mode == "sample":
        kw["num_return_sequences"] = draw(st.integers(1, 2))
    if kw["do_sample"]:
        kw["temperature"] = draw(st.sampled_from([1.0, 0.7, 1.3]))
        options = {"top_k": st.sampled_from([0, 1, 5, 20]), "top_p": st.sampled_from([0.3, 0.8, 1.0]),
                   "min_p": st.sampled_from([0.05, 0.3]), "typical_p": st.sampled_from([0.4, 0.9]),
                   "epsilon_cutoff": st.sampled_from([0.01, 0.1]), "eta_cutoff": st.sampled_from([0.01, 0.1])}
        for name in draw(st.sets(st.sampled_from(sorted(options)), max_size=3)):
            kw[name] = draw(options[name])
    # no EOS at all ([]) crashes transformers' beam search (an IndexError, not a refusal)
    choice = draw(st.sampled_from(["none", "one", "list"] + ([] if "num_beams" in kw else ["empty"])))
    if choice != "none":
        kw["eos_token_id"] = {"one": draw(token), "list": draw(st.lists(token, min_size=1, max_size=2, unique=True)),
                              "empty": []}[choice]
    optional = {
        "pad_token_id": st.sampled_from([0, 1, tokens[0]]),
        "no_repeat_ngram_size": st.integers(1, 3),
        "encoder_no_repeat_ngram_size": st.integers(1, 3),
        "repetition_penalty": st.sampled_from([1.3, 0.8, 2.0]),
        "min_length": st.integers(0, 7),
        "min_new_tokens": st.integers(0, 6),
        "max_length": st.integers(2, 10),
        "bad_words_ids": st.lists(st.lists(token, min_size=1, max_size=2), min_size=1, max_size=3),
        "sequence_bias": st.lists(st.tuples(st.lists(token, min_size=1, max_size=2).map(tuple),
                                            st.sampled_from([-3.0, 2.0])), min_size=1, max_size=2).map(dict),
        "suppress_tokens": st.lists(token, min_size=1, max_size=2),
        "begin_suppress_tokens": st.lists(token, min_size=1, max_size=2),
        "forced_bos_token_id": token,
        "forced_eos_token_id": st.one_of(token, st.lists(token, min_size=1, max_size=2, unique=True)),
        "decoder_start_token_id": st.one_of(token, st.lists(token, min_size=rows, max_size=rows).map(torch.tensor)),
        "decoder_input_ids": st.integers(1, 3).flatmap(lambda n: st.lists(
            st.lists(token, min_size=n, max_size=n), min_size=rows, max_size=rows)).map(torch.tensor),
        "return_dict_in_generate": st.just(True),
    }
    for name in draw(st.sets(st.sampled_from(sorted(optional)), max_size=5)):
        kw[name] = draw(optional[name])
    if "max_length" not in kw or draw(st.booleans()):
        kw["max_new_tokens"] = draw(st.integers(1, 9))
    if kw.get("return_dict_in_generate"):
        kw["output_scores"] = draw(st.booleans())
        kw["output_logits"] = draw(st.booleans())
    if valid or draw(st.integers(0, 7)):
        return kw, None
    name = draw(st.sampled_from(sorted(INVALID)))
    kw[name] = draw(st.sampled_from(INVALID[name]))
    return kw, name


def _run(model, src, mask, kwargs, seed):
    torch.manual_seed(seed)
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        try:
            return model.generate(src, attention_mask=mask, **kwargs)
        except Exception as error:  # noqa: BLE001 - compared below: a refusal must meet a refusal
            return error


def _same_scores(got, expected):
    assert len(got) == len(expected)
    for a, b in zip(got, expected):
        assert torch.equal(a == -float("inf"), b == -float("inf"))
        torch.testing.assert_close(a.masked_fill(a == -float("inf"), 0), b.masked_fill(b == -float("inf"), 0),
                                   atol=1e-4, rtol=0)


# lmkit's documented refusals that transformers accepts
LMKIT_ONLY_REFUSALS = ("return_dict_in_generate is not supported with beam search",)


def compare(hf, ours, src, mask, kwargs, seed=0, invalid=None):
    """Both libraries on the same arguments and seed: equal ids (and scores), or both refuse. lmkit may also
    refuse where transformers goes on, for the `invalid` argument's value or a documented limitation."""
    expected = _run(hf, src, mask, dict(kwargs), seed)
    got = _run(ours, src, mask, dict(kwargs), seed)
    if isinstance(expected, Exception):
        same_crash = type(got) is type(expected) and str(got) == str(expected)  # e.g. torch.multinomial on all -inf
        assert isinstance(got, LmkitError) or same_crash, f"transformers refused ({expected!r}) but lmkit gave {got!r}"
        return
    if isinstance(got, LmkitError) and (invalid is not None or any(s in str(got) for s in LMKIT_ONLY_REFUSALS)):
        return
    assert not isinstance(got, Exception), f"lmkit refused ({got!r}), transformers gave {expected!r}"
    if not torch.is_tensor(expected):
        assert not torch.is_tensor(got), "transformers returned a dict"
        for name in ("scores", "logits"):
            if getattr(expected, name) is None:
                assert getattr(got, name) is None, name
            else:
                _same_scores(getattr(got, name), getattr(expected, name))
        expected, got = expected.sequences, got.sequences
    assert torch.is_tensor(got), got
    assert got.tolist() == expected.tolist()


def free_tokens(ours, src, mask):
    """Tokens the model emits when nothing stops it: the candidates for EOS, bans and prompts."""
    out = ours.generate(src, attention_mask=mask, max_new_tokens=6, eos_token_id=[], forced_eos_token_id=[])
    tokens = sorted(set(out[:, 1:].flatten().tolist()))
    return tokens or [3]


@FUZZ
@given(st.data())
def test_generate_matches_transformers(pairs, data):
    hf, ours, _ = pairs[data.draw(st.integers(0, len(pairs) - 1), label="model")]
    src, mask = sources(data.draw, ours.config.vocab_size, ours.config.pad_token_id)
    kwargs, invalid = generate_kwargs(data.draw, ours.config.vocab_size, src.shape[0], free_tokens(ours, src, mask))
    note(kwargs)
    compare(hf, ours, src, mask, kwargs, seed=data.draw(st.integers(0, 3), label="seed"), invalid=invalid)


@settings(FUZZ, max_examples=max(EXAMPLES // 4, 8))
@given(st.data())
def test_generation_config_json_defaults_match_transformers(pairs, tmp_path_factory, data):
    """The same settings written to generation_config.json instead of passed: lmkit reads them as transformers."""
    hf, _, folder = pairs[data.draw(st.integers(0, len(pairs) - 1), label="model")]
    ours = lmkit.load_model(folder)
    src, mask = sources(data.draw, ours.config.vocab_size, ours.config.pad_token_id)
    kwargs, _ = generate_kwargs(data.draw, ours.config.vocab_size, src.shape[0], free_tokens(ours, src, mask), valid=True)
    if isinstance(kwargs.get("sequence_bias"), dict):  # the JSON form: [[ids, bias], ...]
        kwargs["sequence_bias"] = [[list(ids), bias] for ids, bias in kwargs["sequence_bias"].items()]
    movable = sorted(k for k, v in kwargs.items() if not torch.is_tensor(v))
    moved = data.draw(st.sets(st.sampled_from(movable), min_size=1), label="in generation_config.json")
    note({k: kwargs[k] for k in moved})
    settings_ = {**hf.generation_config.to_dict(), **{k: kwargs[k] for k in moved}}
    target = tmp_path_factory.mktemp("defaults")
    for name in ("config.json", "model.safetensors"):
        (target / name).write_bytes((folder / name).read_bytes())
    try:
        with warnings.catch_warnings():
            warnings.simplefilter("ignore")
            transformers.GenerationConfig(**settings_).save_pretrained(target)
    except ValueError:  # settings transformers will not write
        return
    loaded = transformers.GenerationConfig.from_pretrained(target)
    original, hf.generation_config = hf.generation_config, loaded
    try:
        compare(hf, lmkit.load_model(target), src, mask, {k: v for k, v in kwargs.items() if k not in moved},
                seed=data.draw(st.integers(0, 3), label="seed"))
    finally:
        hf.generation_config = original
