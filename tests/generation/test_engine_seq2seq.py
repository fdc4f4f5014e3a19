"""Encoder-decoder models (T5 v1.0 and v1.1, BART) in the serving engine: requests with sources of different
lengths and mixed settings, queued and decoded together (rows at different decoder lengths), and a group of n
samples of one source, give the tokens and log-probabilities `generate` gives each alone (seeded ones after
torch.manual_seed(seed); a group the rows of generate(num_return_sequences=n))."""
import pytest
import torch

from lmkit.errors import GenerationError
from lmkit.generation import GenerationConfig
from lmkit.generation.engine import Engine, Request

transformers = pytest.importorskip("transformers")

from helpers.beams import peaky  # noqa: E402
from helpers.hub_pairs import saved_pair  # noqa: E402
from helpers.seq2seq_pairs import MODELS  # noqa: E402

SETTINGS = [dict(), dict(do_sample=True, top_k=0), dict(repetition_penalty=1.3, no_repeat_ngram_size=2),
            dict(do_sample=True, temperature=0.8, top_p=0.9), dict(min_new_tokens=4)]


@pytest.fixture(scope="module", params=[0, 1, 3], ids=["t5-v1.0", "t5-v1.1", "bart"])
def model(request, tmp_path_factory):
    name, build, scale = MODELS[request.param]
    torch.manual_seed(request.param)
    _, ours, _ = saved_pair(peaky(build().eval(), scale), name, tmp_path_factory)
    return ours


def _alone(model, request, n=1):
    if request.seed is not None:
        torch.manual_seed(request.seed)
    out = model.generate(torch.tensor([request.prompt]), generation_config=request.config, num_return_sequences=n,
                         return_dict_in_generate=True, output_logits=True)
    rows = [row[1:].tolist() for row in out.sequences]  # after the decoder start token
    logprobs = [[float(torch.log_softmax(step[i], -1)[t]) for step, t in zip(out.logits, row)]
                for i, row in enumerate(rows)]
    return rows, logprobs


def _trim(row, request):
    """generate pads a row that stopped early; the engine's output ends at its EOS."""
    eos = request.decoding.eos
    end = next((i + 1 for i, t in enumerate(row) if t in eos), len(row))
    return row[:end]


def test_engine_equals_generate_for_each_source(model):
    gen = torch.Generator().manual_seed(7)
    vocab = model.config.vocab_size
    requests = []
    for i in range(7):
        source = torch.randint(3, vocab, (int(torch.randint(2, 15, (), generator=gen)),), generator=gen).tolist()
        config = GenerationConfig(max_new_tokens=int(torch.randint(4, 11, (), generator=gen)),
                                  **SETTINGS[i % len(SETTINGS)])
        requests.append(Request(prompt=source, config=config, seed=30 + i, logprobs=0))
    late = Request(prompt=requests[0].prompt[:3], config=GenerationConfig(max_new_tokens=6), logprobs=0)
    engine = Engine(model, max_batch=3, prefill_chunk=4, cache_memory=1 << 26)  # requests queue and join mid-run
    engine.run_all(requests[:4])
    engine.run_all(requests[4:] + [late])
    for request in requests + [late]:
        rows, logprobs = _alone(model, request)
        assert request.output == _trim(rows[0], request), request.config
        assert request.token_logprobs == pytest.approx(logprobs[0][:len(request.output)], abs=1e-4)
    assert engine.free == [0, 1, 2] and engine.prefix is None


def test_a_group_gives_the_rows_of_generate(model):
    source = [5, 9, 12, 7, 4, 8]
    config = GenerationConfig(max_new_tokens=8, do_sample=True, top_k=0)
    members = [Request(prompt=source, config=config, seed=11) for _ in range(3)]
    engine = Engine(model, max_batch=4)
    engine.prepare_group(members)
    other = Request(prompt=[6, 6, 3], config=GenerationConfig(max_new_tokens=5))
    engine.run_all([other] + members)
    rows, _ = _alone(model, members[0], n=3)
    assert [m.output for m in members] == [_trim(row, members[0]) for row in rows]


def test_what_a_source_cannot_have_is_refused(model):
    engine = Engine(model)
    with pytest.raises(GenerationError, match="source"):
        engine.prepare(Request(prompt=[4, 5, 6], prompt_logprobs=1))


def test_engine_equals_generate_over_a_padded_batch_of_sources(model):
    """Greedy rows of sources of 3, 8 and 13 tokens, right-padded into one generate batch with their attention mask,
    are the engine's outputs and log-probabilities for those sources decoded together."""
    sources = [[4, 9, 6], [7, 3, 12, 5, 8, 10, 4, 6], [5, 11, 9, 3, 7, 12, 4, 8, 6, 10, 3, 9, 5]]
    config = GenerationConfig(max_new_tokens=7)
    pad = model.config.pad_token_id or 0
    ids = torch.tensor([s + [pad] * (13 - len(s)) for s in sources])
    mask = torch.tensor([[1] * len(s) + [0] * (13 - len(s)) for s in sources])
    out = model.generate(ids, attention_mask=mask, generation_config=config, return_dict_in_generate=True,
                         output_logits=True)
    requests = [Request(prompt=s, config=config, logprobs=0) for s in sources]
    Engine(model, max_batch=3).run_all(requests)
    for i, request in enumerate(requests):
        row = _trim(out.sequences[i, 1:].tolist(), request)
        assert request.output == row
        expected = [float(torch.log_softmax(step[i], -1)[t]) for step, t in zip(out.logits, row)]
        assert request.token_logprobs == pytest.approx(expected, abs=1e-4)
