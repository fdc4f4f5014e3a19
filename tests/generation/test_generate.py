"""model.generate: greedy, sampling filters, penalties, EOS, stop strings, streaming, batching.

The arguments must mean what transformers' `generate` makes them mean, so most tests run both on
the same weights: after the same torch.manual_seed, sampling draws the same ids (same processors in
the same order, one torch.multinomial per step over the whole batch).
"""
import pytest
import torch

from lmkit.errors import GenerationError
from lmkit.generation import logits as processors

transformers = pytest.importorskip("transformers")
transformers.logging.set_verbosity_error()
from transformers import GPT2Config, GPT2LMHeadModel, LlamaConfig, LlamaForCausalLM  # noqa: E402
from transformers.generation import logits_process as hf_proc  # noqa: E402

VOCAB = 61




def build(kind: str):
    torch.manual_seed(0)
    if kind == "gpt2":
        hf = GPT2LMHeadModel(GPT2Config(vocab_size=VOCAB, n_embd=24, n_layer=2, n_head=2, n_positions=64,
                                        bos_token_id=1, eos_token_id=2))
    else:
        hf = LlamaForCausalLM(LlamaConfig(vocab_size=VOCAB, hidden_size=24, intermediate_size=40, num_hidden_layers=2,
                                          num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=64,
                                          bos_token_id=1, eos_token_id=2))
    with torch.no_grad():  # peaky but not degenerate distributions
        for p in hf.parameters():
            if p.dim() > 1:
                p.normal_(0, 0.3)
    return hf.eval()


@pytest.fixture(scope="module", params=["gpt2", "llama"])
def pair(request, tmp_path_factory):
    from helpers.hub_pairs import saved_pair

    return saved_pair(build(request.param), request.param, tmp_path_factory)[:2]


def prompts():
    g = torch.Generator().manual_seed(3)
    ids = torch.randint(3, VOCAB, (3, 7), generator=g)
    mask = torch.ones_like(ids)
    mask[1, :3] = 0
    mask[2, :1] = 0
    ids = ids.masked_fill(mask == 0, 0)
    return ids, mask


SAMPLING = [
    dict(),                                   # top_k defaults to 50, as in transformers
    dict(top_k=0),                            # plain multinomial over the whole vocabulary
    dict(temperature=0.6, top_k=5),
    dict(top_p=0.8, top_k=0),
    dict(temperature=1.4, top_k=20, top_p=0.9),
    dict(repetition_penalty=1.3, top_p=0.95),
    dict(no_repeat_ngram_size=2, top_k=10),
]


@pytest.mark.parametrize("options", SAMPLING, ids=lambda o: ",".join(f"{k}={v}" for k, v in o.items()) or "defaults")
def test_seeded_sampling_draws_the_same_ids_as_transformers(pair, options):
    hf, ours = pair
    ids, mask = prompts()
    for seed in (0, 1):
        torch.manual_seed(seed)
        expected = hf.generate(ids, attention_mask=mask, do_sample=True, max_new_tokens=12, pad_token_id=0, **options)
        torch.manual_seed(seed)
        got = ours.generate(ids, attention_mask=mask, do_sample=True, max_new_tokens=12, pad_token_id=0, **options)
        assert torch.equal(got, expected), (seed, options)


@pytest.mark.parametrize("options", [dict(top_k=10), dict(top_p=0.9, temperature=0.7)], ids=["top_k", "top_p"])
def test_num_return_sequences_samples_like_transformers(pair, options):
    hf, ours = pair
    ids, mask = prompts()
    common = dict(max_new_tokens=9, do_sample=True, num_return_sequences=3, pad_token_id=0, **options)
    torch.manual_seed(11)
    ref = hf.generate(ids, attention_mask=mask, **common)
    torch.manual_seed(11)
    got = ours.generate(ids, attention_mask=mask, **common)
    assert got.shape[0] == 9 and got.tolist() == ref.tolist()
    assert len({tuple(r) for r in got[:3, 7:].tolist()}) > 1  # three different samples of the first prompt
    with pytest.raises(GenerationError, match="greedy decoding returns one sequence"):
        ours.generate(ids, num_return_sequences=2)
    with pytest.raises(GenerationError, match="at most num_beams"):
        ours.generate(ids, num_beams=2, num_return_sequences=3)


@pytest.mark.parametrize("options", [dict(repetition_penalty=1.5), dict(no_repeat_ngram_size=2),
                                     dict(repetition_penalty=0.7, no_repeat_ngram_size=3)])
def test_greedy_with_penalties_matches_transformers(pair, options):
    hf, ours = pair
    ids, mask = prompts()
    expected = hf.generate(ids, attention_mask=mask, do_sample=False, max_new_tokens=15, pad_token_id=0, **options)
    got = ours.generate(ids, attention_mask=mask, max_new_tokens=15, pad_token_id=0, **options)
    assert torch.equal(got, expected)


@pytest.mark.parametrize("options", [dict(), dict(num_beams=3), dict(do_sample=True, top_k=0, num_return_sequences=2)],
                         ids=["greedy", "beams", "sampling"])
def test_repetition_penalty_skips_left_padding_like_transformers(pair, options):
    """transformers' penalty does not count a row's left padding as seen, whatever ids fill it: here the pads
    hold the very tokens the rows go on to pick, which a penalty over the whole row would push down."""
    hf, ours = pair
    ids, mask = prompts()
    free = ours.generate(ids, attention_mask=mask, max_new_tokens=7, eos_token_id=[])[:, 7:]
    ids = torch.where(mask == 0, free, ids)
    common = dict(max_new_tokens=10, repetition_penalty=2.0, pad_token_id=0, **options)
    torch.manual_seed(4)
    expected = hf.generate(ids, attention_mask=mask, **{"do_sample": False, **common})
    torch.manual_seed(4)
    got = ours.generate(ids, attention_mask=mask, **common)
    assert got.tolist() == expected.tolist()


def test_eos_stops_rows_and_pads_them_like_transformers(pair):
    hf, ours = pair
    ids, mask = prompts()
    free = ours.generate(ids, attention_mask=mask, max_new_tokens=12, eos_token_id=[], pad_token_id=0)
    eos = int(free[1, 7 + 3])  # the token row 1 produces at its fourth step
    for kw in (dict(eos_token_id=eos), dict(eos_token_id=[eos, int(free[0, 7 + 5])]), dict(eos_token_id=eos, min_new_tokens=6)):
        expected = hf.generate(ids, attention_mask=mask, max_new_tokens=12, do_sample=False, pad_token_id=0, **kw)
        got = ours.generate(ids, attention_mask=mask, max_new_tokens=12, pad_token_id=0, **kw)
        assert torch.equal(got, expected), kw
    got = ours.generate(ids, attention_mask=mask, max_new_tokens=12, pad_token_id=0, eos_token_id=eos)
    row = got[1, 7:].tolist()
    first = row.index(eos)
    assert first <= 3 and set(row[first + 1:]) <= {0}  # finished rows get pad_token_id


def test_max_length_and_min_length_count_the_prompt_like_transformers(pair):
    """generate(max_length=N) stops at N tokens in all; min_length=M holds EOS back until M tokens in all;
    max_new_tokens / min_new_tokens win over them, even when smaller."""
    hf, ours = pair
    ids, mask = prompts()
    free = ours.generate(ids, attention_mask=mask, max_new_tokens=12, eos_token_id=[], pad_token_id=0)
    eos = int(free[1, 7 + 2])
    for kw in (dict(max_length=15), dict(max_length=18, min_length=14), dict(max_length=18, min_length=12, num_beams=3),
               dict(max_new_tokens=5, max_length=30), dict(max_length=16, min_length=9, min_new_tokens=6),
               dict(max_length=18, min_length=14, min_new_tokens=1), dict(max_length=18, min_length=14, min_new_tokens=0)):
        expected = hf.generate(ids, attention_mask=mask, do_sample=False, pad_token_id=0, eos_token_id=eos, **kw)
        got = ours.generate(ids, attention_mask=mask, pad_token_id=0, eos_token_id=eos, **kw)
        assert got.tolist() == expected.tolist(), kw


def test_unset_length_is_transformers_default(pair):
    """Without max_new_tokens (argument or folder): 20 new tokens, fewer where the 64 positions run out."""
    hf, ours = pair
    ids, mask = prompts()
    long = torch.randint(3, VOCAB, (2, 50), generator=torch.Generator().manual_seed(4))
    for prompt, m, new in ((ids, mask, 20), (long, None, 14)):
        expected = hf.generate(prompt, attention_mask=m, do_sample=False, pad_token_id=0, eos_token_id=None)
        got = ours.generate(prompt, attention_mask=m, pad_token_id=0, eos_token_id=[])
        assert got.tolist() == expected.tolist() and got.shape[1] == prompt.shape[1] + new


def test_pad_tokens_without_an_attention_mask_are_padding_like_transformers(pair):
    """No attention_mask: as transformers does, pad_token_id marks padding, unless it is also an EOS token."""
    hf, ours = pair
    ids, mask = prompts()  # the left padding holds token 0
    for kw in (dict(pad_token_id=0), dict(pad_token_id=0, eos_token_id=[0, 2])):
        expected = hf.generate(ids, do_sample=False, max_new_tokens=8, **kw)
        got = ours.generate(ids, max_new_tokens=8, **kw)
        assert got.tolist() == expected.tolist(), kw
    assert got.tolist() != ours.generate(ids, attention_mask=mask, max_new_tokens=8, **kw).tolist()
    assert ours.generate(ids, max_new_tokens=8, pad_token_id=0).tolist() == \
        ours.generate(ids, attention_mask=mask, max_new_tokens=8, pad_token_id=0).tolist()


def test_a_padded_batch_generates_each_row_as_if_alone(pair):
    _, ours = pair
    ids, mask = prompts()
    together = ours.generate(ids, attention_mask=mask, max_new_tokens=10, eos_token_id=[])
    for row in range(3):
        alone = ours.generate(ids[row:row + 1, mask[row].bool()], max_new_tokens=10, eos_token_id=[])
        assert torch.equal(together[row, 7:], alone[0, -10:])


def test_incremental_greedy_equals_full_recomputation(pair):
    _, ours = pair
    ids, _ = prompts()
    got = ours.generate(ids, max_new_tokens=12, eos_token_id=[])
    seq = ids
    with torch.no_grad():
        for _ in range(12):
            seq = torch.cat([seq, ours(seq).logits[:, -1].argmax(-1, keepdim=True)], 1)
    assert torch.equal(got, seq)


def test_max_new_tokens_streaming_and_one_dimensional_prompts(pair):
    _, ours = pair
    ids, mask = prompts()
    with pytest.raises(ValueError, match="max_new_tokens must be >= 1"):  # transformers' ValueError too
        ours.generate(ids, max_new_tokens=0)
    out = ours.generate(ids[0], max_new_tokens=5, eos_token_id=[])
    assert out.shape == (1, 12)

    class Collect:
        def __init__(self):
            self.parts, self.ended = [], False

        def put(self, value):
            self.parts.append(value)

        def end(self):
            self.ended = True

    streamer = Collect()
    out = ours.generate(ids, attention_mask=mask, max_new_tokens=6, eos_token_id=[], streamer=streamer)
    assert streamer.ended and torch.equal(streamer.parts[0], ids)
    assert torch.equal(torch.stack(streamer.parts[1:], 1), out[:, 7:])


def test_stop_strings_end_a_row_once_its_text_contains_one(pair):
    _, ours = pair

    class Letters:
        """A toy tokenizer: id i is the letter chr(97 + i % 26)."""

        def decode(self, ids, skip_special_tokens=False):
            return "".join(chr(97 + i % 26) for i in ids)

    ids, mask = prompts()
    free = ours.generate(ids, attention_mask=mask, max_new_tokens=12, eos_token_id=[], pad_token_id=0)
    text = Letters().decode(free[0, 7:].tolist())
    stop = text[4:6]
    first = text.index(stop) + len(stop)  # the row must stop right after the stop string first appears
    out = ours.generate(ids, attention_mask=mask, max_new_tokens=12, eos_token_id=[], pad_token_id=0,
                        stop_strings=stop, tokenizer=Letters())
    assert torch.equal(out[0, 7:7 + first], free[0, 7:7 + first])
    assert set(out[0, 7 + first:].tolist()) <= {0}
    with pytest.raises(GenerationError, match="tokenizer"):
        ours.generate(ids, stop_strings="x")


def test_seeded_sampling_repeats_and_differs_across_seeds(pair):
    _, ours = pair
    ids, _ = prompts()
    runs = []
    for seed in (5, 5, 6):
        torch.manual_seed(seed)
        runs.append(ours.generate(ids, do_sample=True, top_k=0, max_new_tokens=10, eos_token_id=[]))
    assert torch.equal(runs[0], runs[1]) and not torch.equal(runs[0], runs[2])


def test_bad_arguments_raise_generation_errors(pair):
    _, ours = pair
    ids, _ = prompts()
    too_long = torch.zeros(1, 65, dtype=torch.long)
    with pytest.raises(GenerationError, match="context"):
        ours.generate(too_long, max_new_tokens=1)
    with pytest.raises(GenerationError, match="temperature"):
        ours.generate(ids, do_sample=True, temperature=0.0)
    with pytest.raises(GenerationError, match="top_p"):
        ours.generate(ids, do_sample=True, top_p=1.5)
    with pytest.raises(GenerationError, match="max_new_tokens"):
        ours.generate(ids, max_new_tokens=-1)
    for bad, name in ((dict(num_beams=0), "num_beams"), (dict(do_sample=True, top_k=-1), "top_k"),
                      (dict(repetition_penalty=0.0), "repetition_penalty")):
        with pytest.raises(GenerationError, match=name):  # transformers refuses each of these too
            ours.generate(ids, max_new_tokens=2, **bad)
    with pytest.raises(GenerationError, match="streamer"):
        ours.generate(ids, max_new_tokens=2, num_beams=2, streamer=object())
    with pytest.raises(GenerationError, match="empty"):
        ours.generate(ids[:, :0], max_new_tokens=2)
    if ours.config.position == "learned":  # no positions left for the continuation
        with pytest.raises(GenerationError, match="max_new_tokens"):
            ours.generate(ids, max_new_tokens=60)


# --- the processors themselves against transformers' classes ------------------------------------

def scores_and_sequences():
    g = torch.Generator().manual_seed(0)
    scores = torch.randn(4, 50, generator=g) * 3
    scores[0, :10] = 1.0  # ties at the top-k boundary
    return torch.randint(0, 50, (4, 9), generator=g), scores


@pytest.mark.parametrize("k", [1, 3, 10, 50, 80])
def test_top_k_filter_matches_transformers(k):
    seqs, scores = scores_and_sequences()
    expected = hf_proc.TopKLogitsWarper(k)(seqs, scores.clone())
    assert torch.equal(processors.top_k_filter(scores, k), expected)


@pytest.mark.parametrize("p", [0.05, 0.3, 0.9, 0.999, 1.0])
def test_top_p_filter_matches_transformers(p):
    seqs, scores = scores_and_sequences()
    expected = hf_proc.TopPLogitsWarper(p)(seqs, scores.clone()) if p < 1 else scores
    got = processors.top_p_filter(scores, p)
    assert torch.equal(got, expected)
    assert (got > -float("inf")).sum(-1).min() >= 1  # at least one token always survives


@pytest.mark.parametrize("penalty", [0.5, 1.2, 2.0])
def test_repetition_penalty_matches_transformers(penalty):
    seqs, scores = scores_and_sequences()
    expected = hf_proc.RepetitionPenaltyLogitsProcessor(penalty)(seqs, scores.clone())
    torch.testing.assert_close(processors.repetition_penalty(seqs, scores, penalty), expected, rtol=0, atol=0)


@pytest.mark.parametrize("n", [1, 2, 3])
def test_no_repeat_ngram_matches_transformers(n):
    seqs = torch.tensor([[1, 2, 3, 1, 2, 3, 1, 2], [4, 4, 4, 4, 4, 4, 4, 4]])
    scores = torch.randn(2, 10)
    expected = hf_proc.NoRepeatNGramLogitsProcessor(n)(seqs, scores.clone())
    assert torch.equal(processors.no_repeat_ngram(seqs, scores, n), expected)


def _processors(**settings):
    from lmkit.generation.config import GenerationConfig
    from lmkit.generation.processors import build_processors

    cfg = GenerationConfig(**settings).resolved()
    ids = torch.zeros(4, 3, dtype=torch.long)
    return build_processors(cfg, 50, [2, 5], start=3, max_length=12, min_new_tokens=settings.get("min_new_tokens", 0),
                            prompts=ids)


def test_temperature_divides_the_logits():
    seqs, scores = scores_and_sequences()
    out = _processors(do_sample=True, temperature=0.5, top_k=0)(seqs, scores)
    assert torch.equal(out, hf_proc.TemperatureLogitsWarper(0.5)(seqs, scores.clone()))
    # greedy ignores the sampling filters, as transformers does
    greedy = _processors(do_sample=False, temperature=0.5, top_k=3, top_p=0.5)
    assert len(greedy) == 0 and torch.equal(greedy(seqs, scores), scores)


def test_the_processor_list_from_a_config_equals_transformers_list():
    """One config asking for most processors: the list built from it, step by step, equals transformers' list of
    the same processors in its order (`_get_logits_processor`)."""
    settings = dict(do_sample=True, temperature=0.7, top_k=20, top_p=0.9, min_p=0.02, repetition_penalty=1.3,
                    no_repeat_ngram_size=2, sequence_bias=[[[4], 1.5]], bad_words_ids=[[7, 8]], min_new_tokens=2,
                    suppress_tokens=[11], begin_suppress_tokens=[12], forced_eos_token_id=[5])
    ours = _processors(**settings)
    theirs = hf_proc.LogitsProcessorList([
        hf_proc.SequenceBiasLogitsProcessor({(4,): 1.5}), hf_proc.RepetitionPenaltyLogitsProcessor(1.3),
        hf_proc.NoRepeatNGramLogitsProcessor(2), hf_proc.NoBadWordsLogitsProcessor([[7, 8]], eos_token_id=[2, 5]),
        hf_proc.MinNewTokensLengthLogitsProcessor(3, 2, [2, 5]), hf_proc.ForcedEOSTokenLogitsProcessor(12, [5]),
        hf_proc.SuppressTokensLogitsProcessor([11]), hf_proc.SuppressTokensAtBeginLogitsProcessor([12], 3),
        hf_proc.TemperatureLogitsWarper(0.7), hf_proc.TopKLogitsWarper(20), hf_proc.TopPLogitsWarper(0.9),
        hf_proc.MinPLogitsWarper(0.02)])
    g = torch.Generator().manual_seed(3)
    for length in range(3, 12):
        seqs = torch.randint(0, 50, (4, length), generator=g)
        seqs[:, -1] = 7  # bad word [7, 8] is one token away
        scores = torch.randn(4, 50, generator=g) * 3
        assert torch.equal(ours(seqs, scores.clone()), theirs(seqs, scores.clone())), length
