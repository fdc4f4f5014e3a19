"""generate's optional logits processors (min_p, typical_p, epsilon/eta cutoffs, bad words, sequence bias,
suppressed tokens) and the order transformers applies them in, on GPT-2 and LLaMA against `generate` itself.

Beam sampling keeps one more token than there are EOS tokens through every truncation filter (transformers'
min_tokens_to_keep), and forced BOS/EOS come before the sampling filters, not after.
"""
import pytest
import torch

from lmkit.errors import GenerationError
from lmkit.generation import logits as processors
from lmkit.generation.processors import bad_words_table, sequence_bias_table

transformers = pytest.importorskip("transformers")
from transformers.generation import logits_process as hf_proc  # noqa: E402

from test_generate import VOCAB, build, prompts  # noqa: E402
from helpers.hub_pairs import saved_pair  # noqa: E402


@pytest.fixture(scope="module", params=["gpt2", "llama"])
def pair(request, tmp_path_factory):
    """(transformers model, lmkit model loaded from its folder): test_generate's peaky small models."""
    return saved_pair(build(request.param), request.param, tmp_path_factory)[:2]




def both(hf, ours, seed=0, **kwargs):
    ids, mask = prompts()
    torch.manual_seed(seed)
    expected = hf.generate(ids, attention_mask=mask, pad_token_id=0, **kwargs)
    torch.manual_seed(seed)
    got = ours.generate(ids, attention_mask=mask, pad_token_id=0, **kwargs)
    return got.tolist(), expected.tolist()


@pytest.mark.parametrize("options", [dict(top_k=1), dict(top_p=0.05, top_k=0), dict(min_p=0.9),
                                     dict(typical_p=0.05), dict(epsilon_cutoff=0.5), dict(eta_cutoff=0.5)],
                         ids=lambda o: ",".join(f"{k}={v}" for k, v in o.items()))
def test_beam_sampling_keeps_one_more_token_than_the_eos_tokens(pair, options):
    """With top_k=1 alone, beam sampling would have one candidate per beam; transformers keeps len(eos) + 1."""
    hf, ours = pair
    for eos in (None, 2, [2, 5]):
        kwargs = dict(do_sample=True, num_beams=3, max_new_tokens=8, num_return_sequences=2, **options)
        if eos is not None:
            kwargs["eos_token_id"] = eos
        for seed in (0, 1):
            got, expected = both(hf, ours, seed, **kwargs)
            assert got == expected, (eos, seed)


def test_forced_eos_comes_before_the_sampling_filters(pair):
    """Two forced EOS tokens tie at 0; top_p then keeps only one of them, as in transformers."""
    hf, ours = pair
    for seed in range(4):
        got, expected = both(hf, ours, seed, do_sample=True, top_p=0.3, top_k=0, max_new_tokens=4,
                             forced_eos_token_id=[7, 9], eos_token_id=[])
        assert got == expected, seed


SAMPLING = [dict(min_p=0.2), dict(min_p=0.05, temperature=0.7, top_k=0), dict(typical_p=0.6, top_k=0),
            dict(epsilon_cutoff=0.03, top_k=0), dict(eta_cutoff=0.02, top_k=0),
            dict(top_k=20, top_p=0.9, min_p=0.1, typical_p=0.9, epsilon_cutoff=0.005, eta_cutoff=0.005)]


@pytest.mark.parametrize("options", SAMPLING, ids=lambda o: ",".join(f"{k}={v}" for k, v in o.items()))
def test_sampling_filters_draw_the_same_ids_as_transformers(pair, options):
    hf, ours = pair
    for seed in (0, 1):
        got, expected = both(hf, ours, seed, do_sample=True, max_new_tokens=10, **options)
        assert got == expected, seed


def free_run(ours):
    ids, mask = prompts()
    return ours.generate(ids, attention_mask=mask, max_new_tokens=8, eos_token_id=[], pad_token_id=0)[:, 7:].tolist()


@pytest.mark.parametrize("mode", [dict(), dict(num_beams=3), dict(do_sample=True, top_k=5)],
                         ids=["greedy", "beams", "sampling"])
def test_bad_words_sequence_bias_and_suppressed_tokens_match_transformers(pair, mode):
    hf, ours = pair
    free = free_run(ours)
    # ban / bias what the rows would pick: single tokens, and two-token sequences whose prefix is in the prompt
    cases = [dict(bad_words_ids=[[free[0][0]], [free[1][1]], [free[2][0], free[2][1]]]),
             dict(bad_words_ids=[[free[0][2], free[0][3]], [2]], eos_token_id=2),  # a lone EOS is not banned
             dict(sequence_bias=[[[free[0][0]], -4.0], [[free[1][0], free[1][1]], -8.0], [[free[2][3]], 3.5]]),
             dict(sequence_bias={(free[0][1],): 2.0, (free[2][0], free[2][1]): -1.5}),
             dict(suppress_tokens=[free[0][0], free[1][0], free[2][0], VOCAB + 4]),
             dict(begin_suppress_tokens=[free[0][0], free[1][0], free[2][0]]),
             dict(begin_suppress_tokens=[free[0][1]], forced_bos_token_id=5),
             dict(encoder_no_repeat_ngram_size=1), dict(encoder_no_repeat_ngram_size=2)]  # the prompt's n-grams
    for case in cases:
        got, expected = both(hf, ours, 3, max_new_tokens=8, **mode, **case)
        assert got == expected, case
    got, _ = both(hf, ours, 3, max_new_tokens=8, suppress_tokens=[free[0][0], free[1][0], free[2][0]])
    assert [row[7] for row in got] != [row[0] for row in free]


def test_bad_processor_arguments_raise_generation_errors(pair):
    _, ours = pair
    ids, _ = prompts()
    for bad, name in ((dict(min_p=1.5), "min_p"), (dict(typical_p=0.0), "typical_p"),
                      (dict(epsilon_cutoff=1.0), "epsilon_cutoff"), (dict(eta_cutoff=-0.1), "eta_cutoff"),
                      (dict(bad_words_ids=[3, 4]), "bad_words_ids"), (dict(bad_words_ids=[[VOCAB]]), "vocabulary"),
                      (dict(sequence_bias=[[[3], "x"]]), "sequence_bias"), (dict(sequence_bias=[]), "sequence_bias"),
                      (dict(suppress_tokens=5), "suppress_tokens"), (dict(begin_suppress_tokens=["a"]), "begin_suppress")):
        with pytest.raises(GenerationError, match=name):
            ours.generate(ids, max_new_tokens=2, do_sample=True, **bad)


# --- the filters themselves against transformers' classes, at min_tokens_to_keep 1 to 3 -------------------

def scores_and_sequences():
    g = torch.Generator().manual_seed(0)
    scores = torch.randn(5, 40, generator=g) * 3
    scores[0, :8] = 1.0  # ties
    scores[1, 5:30] = -float("inf")  # tokens already banned
    scores[2] *= 0.05  # nearly flat
    return torch.randint(0, 40, (5, 6), generator=g), scores


FILTERS = [(processors.top_k_filter, hf_proc.TopKLogitsWarper, (1, 4)),
           (processors.top_p_filter, hf_proc.TopPLogitsWarper, (0.05, 0.5, 0.95)),
           (processors.min_p_filter, hf_proc.MinPLogitsWarper, (0.0, 0.1, 0.6, 1.0)),
           (processors.typical_filter, hf_proc.TypicalLogitsWarper, (0.05, 0.5, 0.95)),
           (processors.epsilon_filter, hf_proc.EpsilonLogitsWarper, (0.001, 0.05, 0.5)),
           (processors.eta_filter, hf_proc.EtaLogitsWarper, (0.001, 0.05, 0.5))]


@pytest.mark.parametrize("ours,theirs,values", FILTERS, ids=[f[1].__name__ for f in FILTERS])
def test_filters_match_transformers(ours, theirs, values):
    seqs, scores = scores_and_sequences()
    for value in values:
        for keep in (1, 2, 3):
            expected = theirs(value, min_tokens_to_keep=keep)(seqs, scores.clone())
            assert torch.equal(ours(scores.clone(), value, keep), expected), (value, keep)


def test_sequence_bias_and_bad_words_match_transformers():
    g = torch.Generator().manual_seed(1)
    seqs = torch.randint(0, 4, (6, 5), generator=g)  # few distinct ids, so prefixes match often
    scores = torch.randn(6, 12, generator=g)
    table = [[[1], -2.0], [[2, 3], 1.5], [[0, 2, 3], 4.0], [[3, 3], -1.0], [[1, 3], 0.5], [[7, 0, 1, 2, 3, 1], 9.0]]
    expected = hf_proc.SequenceBiasLogitsProcessor(table)(seqs, scores.clone())
    assert torch.equal(sequence_bias_table(table, 12)(seqs, scores.clone()), expected)
    words = [s for s, _ in table]
    expected = hf_proc.NoBadWordsLogitsProcessor(words, eos_token_id=[1])(seqs, scores.clone())
    assert torch.equal(bad_words_table(words, [1], 12)(seqs, scores.clone()), expected)


@pytest.mark.parametrize("mode", [dict(), dict(do_sample=True, top_k=6, num_return_sequences=2),
                                  dict(do_sample=True, top_p=0.8, min_p=0.05, repetition_penalty=1.3, min_new_tokens=3)],
                         ids=["greedy", "top_k", "top_p-min_p-penalty"])
def test_return_dict_in_generate_gives_transformers_scores_and_logits(pair, mode):
    hf, ours = pair
    kwargs = dict(max_new_tokens=9, eos_token_id=free_run(ours)[1][4], return_dict_in_generate=True,
                  output_scores=True, output_logits=True, **mode)
    ids, mask = prompts()
    torch.manual_seed(2)
    expected = hf.generate(ids, attention_mask=mask, pad_token_id=0, **kwargs)
    torch.manual_seed(2)
    got = ours.generate(ids, attention_mask=mask, pad_token_id=0, **kwargs)
    assert got.sequences.tolist() == expected.sequences.tolist() and got["sequences"] is got.sequences
    for name in ("scores", "logits"):
        assert len(got[name]) == len(expected[name]) == got.sequences.shape[1] - 7
        for a, b in zip(got[name], expected[name]):
            assert a.dtype == torch.float32 and torch.equal(a == -float("inf"), b == -float("inf"))
            torch.testing.assert_close(a.masked_fill(a == -float("inf"), 0), b.masked_fill(b == -float("inf"), 0),
                                       atol=1e-4, rtol=0)
    plain = ours.generate(ids, attention_mask=mask, max_new_tokens=3, output_scores=True)
    assert torch.is_tensor(plain)  # output_scores alone changes nothing, as in transformers
    only = ours.generate(ids, attention_mask=mask, max_new_tokens=3, return_dict_in_generate=True)
    assert only.scores is None and only.logits is None and only.sequences.shape == (3, 10)
    with pytest.raises(GenerationError, match="beam search"):
        ours.generate(ids, max_new_tokens=3, num_beams=2, return_dict_in_generate=True)
