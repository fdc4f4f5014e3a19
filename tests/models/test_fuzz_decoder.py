"""Hypothesis fuzzing of `CausalLM.generate` against transformers' `generate` on GPT-2 and LLaMA (GQA) models of odd
sizes that transformers saved: the same ids for batched, left-padded prompts under greedy decoding and beam search
with every length, EOS, padding, penalty and ban argument, or a refusal where transformers refuses. Sampling is left
to models/test_fuzz_seq2seq.py and the generate tests: one seeded draw per step is a property of the loop, not of the model.

DEC_FUZZ_EXAMPLES raises the number of argument sets (the suite runs a few dozen).
"""
import pytest
import torch
from hypothesis import given, note, strategies as st

transformers = pytest.importorskip("transformers")
transformers.logging.set_verbosity_error()

from test_fuzz_seq2seq import Pairs, compare, fuzz_settings  # noqa: E402

EXAMPLES, FUZZ = fuzz_settings("DEC_FUZZ_EXAMPLES")


def _gpt2(vocab, d_model, heads, layers):
    cfg = transformers.GPT2Config(vocab_size=vocab, n_embd=d_model, n_head=heads, n_layer=layers, n_positions=40,
                                  bos_token_id=1, eos_token_id=2, resid_pdrop=0.0, embd_pdrop=0.0, attn_pdrop=0.0)
    return transformers.GPT2LMHeadModel(cfg)


def _llama(vocab, d_model, heads, kv_heads, ffn, layers, tied):
    cfg = transformers.LlamaConfig(vocab_size=vocab, hidden_size=d_model, num_attention_heads=heads,
                                   num_key_value_heads=kv_heads, intermediate_size=ffn, num_hidden_layers=layers,
                                   max_position_embeddings=64, tie_word_embeddings=tied, bos_token_id=1,
                                   eos_token_id=2, pad_token_id=0)
    return transformers.LlamaForCausalLM(cfg)


# (name, builder, output-layer scale: distributions peaked enough that EOS and bans matter, not one-hot)
MODELS = [("gpt2", lambda: _gpt2(67, 24, 3, 2), 4.0), ("llama-gqa", lambda: _llama(59, 32, 4, 2, 40, 2, False), 3.0),
          ("llama-tied", lambda: _llama(53, 24, 2, 1, 30, 1, True), 6.0)]


@pytest.fixture(scope="module")
def pairs(tmp_path_factory):
    return Pairs(MODELS, tmp_path_factory)


def free_tokens(ours, ids, mask):
    """Tokens the model continues with when nothing stops it: the candidates for EOS, bans and forced ids."""
    out = ours.generate(ids, attention_mask=mask, max_new_tokens=6, eos_token_id=[], pad_token_id=0)
    return sorted(set(out[:, ids.shape[1]:].flatten().tolist()))


def prompts(draw, vocab):
    """Prompts (each row at least one real token), mostly left-padded, and their mask; the pad id is 0."""
    rows, length = draw(st.integers(1, 3)), draw(st.integers(1, 7))
    ids = torch.tensor(draw(st.lists(st.lists(st.integers(3, vocab - 1), min_size=length, max_size=length),
                                     min_size=rows, max_size=rows)))
    lengths = torch.tensor(draw(st.lists(st.integers(1, length), min_size=rows, max_size=rows)))[:, None]
    mask = (torch.arange(length)[None] < lengths).long()
    if draw(st.integers(0, 3)):  # now and then right-padded: a prompt that ends in padding
        mask = mask.flip(1)
    return ids.masked_fill(mask == 0, 0), mask


# a value transformers refuses (or lmkit refuses as its documented stricter check)
INVALID = {"num_beams": [0], "num_return_sequences": [0, 9], "max_new_tokens": [0, -1], "max_length": [1],
           "repetition_penalty": [0.0], "no_repeat_ngram_size": [-1], "early_stopping": ["always"],
           "bad_words_ids": [[[]], [3, 4]]}


def decode_kwargs(draw, prompt_len, tokens):
    """(greedy or beam-search arguments, the name of an invalid one or None); `tokens` are ids the model emits when
    left alone, so EOS, bans and forced ids take effect."""
    token = st.sampled_from(tokens)
    kw = {"do_sample": False}
    if draw(st.booleans()):
        kw["num_beams"] = draw(st.integers(2, 4))
        kw["length_penalty"] = draw(st.sampled_from([1.0, 0.5, 2.0, -1.0, 0.0]))
        kw["early_stopping"] = draw(st.sampled_from([False, True, "never"]))
        kw["num_return_sequences"] = draw(st.integers(1, kw["num_beams"]))
    choice = draw(st.sampled_from(["none", "one", "list"] + ([] if "num_beams" in kw else ["empty"])))
    if choice != "none":
        kw["eos_token_id"] = {"one": draw(token), "list": draw(st.lists(token, min_size=1, max_size=3, unique=True)),
                              "empty": []}[choice]
    if choice == "empty":  # transformers' decoder-only generate takes the pad id from eos_token_id[0] (IndexError)
        kw["pad_token_id"] = 0
    optional = {
        "pad_token_id": st.sampled_from([0, 1, tokens[0]]),
        "no_repeat_ngram_size": st.integers(1, 3),
        "repetition_penalty": st.sampled_from([1.3, 0.8, 2.0]),
        "min_length": st.integers(0, prompt_len + 6),
        "min_new_tokens": st.integers(0, 6),
        "max_length": st.integers(prompt_len + 1, prompt_len + 9),
        "bad_words_ids": st.lists(st.lists(token, min_size=1, max_size=2), min_size=1, max_size=3),
        "suppress_tokens": st.lists(token, min_size=1, max_size=2),
        "begin_suppress_tokens": st.lists(token, min_size=1, max_size=2),
        "forced_eos_token_id": st.one_of(token, st.lists(token, min_size=1, max_size=2, unique=True)),
        "sequence_bias": st.lists(st.tuples(st.lists(token, min_size=1, max_size=2).map(tuple),
                                            st.sampled_from([-3.0, 2.0])), min_size=1, max_size=2).map(dict),
    }
    for name in draw(st.sets(st.sampled_from(sorted(optional)), max_size=5)):
        kw[name] = draw(optional[name])
    if "max_length" not in kw or draw(st.booleans()):
        kw["max_new_tokens"] = draw(st.integers(1, 9))
    if "num_beams" not in kw and draw(st.integers(0, 3)) == 0:
        kw.update(return_dict_in_generate=True, output_scores=draw(st.booleans()), output_logits=draw(st.booleans()))
    if draw(st.integers(0, 7)):
        return kw, None
    name = draw(st.sampled_from(sorted(INVALID)))
    kw[name] = draw(st.sampled_from(INVALID[name]))
    return kw, name


@FUZZ
@given(st.data())
def test_greedy_and_beam_generate_match_transformers(pairs, data):
    hf, ours, _ = pairs[data.draw(st.integers(0, len(pairs) - 1), label="model")]
    ids, mask = prompts(data.draw, ours.config.vocab_size)
    tokens = free_tokens(ours, ids, mask)
    kwargs, invalid = decode_kwargs(data.draw, ids.shape[1], tokens)
    if data.draw(st.integers(0, 4)) == 0 and "pad_token_id" in kwargs:  # transformers infers the mask from pads
        mask = None
    note(kwargs)
    compare(hf, ours, ids, mask, kwargs, invalid=invalid)


@pytest.mark.parametrize("beams", [1, 3])
def test_prompts_that_end_in_padding_match_transformers(pairs, beams):
    """A prompt whose last tokens are masked: transformers 5 puts padding at position 0 and continues from the last
    position + 1, so the logits of each step, and the ids, are its own."""
    for hf, ours, _ in pairs:
        ids = torch.tensor([[5, 6, 7, 0, 0], [0, 8, 9, 10, 11], [12, 13, 14, 15, 0]])
        mask = (ids != 0).long()
        kw = dict(attention_mask=mask, max_new_tokens=6, num_beams=beams, pad_token_id=0)
        want = hf.generate(ids, do_sample=False, return_dict_in_generate=True, output_logits=True, **kw)
        assert ours.generate(ids, **kw).tolist() == want.sequences.tolist()
        if beams == 1:
            got = ours.generate(ids, return_dict_in_generate=True, output_logits=True, **kw)
            for a, b in zip(got.logits, want.logits):
                torch.testing.assert_close(a, b, atol=1e-5, rtol=0)
