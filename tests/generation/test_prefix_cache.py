"""Automatic prefix caching: requests sharing a system prompt, multi-turn chats that resend their history, seeded
sampling and greedy rows in one batch give the same tokens and log-probabilities with the cache as without it,
take their shared blocks from it, and the cache keeps within its byte budget."""
import pytest
import torch

import lmkit
from lmkit.errors import GenerationError
from lmkit.generation import GenerationConfig
from lmkit.generation.engine import Engine, Request
from lmkit.generation.prefix_cache import BLOCK, PrefixCache, token_bytes

pytest.importorskip("transformers")
from serving_folders import make_folder  # noqa: E402

MiB = 1 << 20


@pytest.fixture(scope="module", params=["gpt2", "llama"])
def model(request, tmp_path_factory):
    return lmkit.load_model(make_folder(tmp_path_factory.mktemp(request.param), request.param))


def _wave(vocab: int, system: list[int], seed: int, count: int = 6) -> list[Request]:
    gen = torch.Generator().manual_seed(seed)
    out = []
    for i in range(count):
        suffix = torch.randint(0, vocab, (int(torch.randint(1, 30, (), generator=gen)),), generator=gen).tolist()
        sample = dict(do_sample=True, temperature=0.8, top_p=0.9) if i % 2 else {}
        config = GenerationConfig(max_new_tokens=int(torch.randint(3, 12, (), generator=gen)), **sample)
        out.append(Request(prompt=system[:BLOCK * (i % 4) + 5] + suffix if i % 3 else system + suffix,
                           config=config, seed=seed + i, logprobs=1))
    return out


def _same(a: list[Request], b: list[Request]) -> None:
    for x, y in zip(a, b):
        assert x.output == y.output
        assert torch.allclose(torch.tensor(x.token_logprobs), torch.tensor(y.token_logprobs), atol=1e-5)


def test_shared_prefixes_and_resent_histories_decode_as_without_the_cache(model):
    vocab = model.config.vocab_size
    system = torch.randint(0, vocab, (3 * BLOCK + 7,), generator=torch.Generator().manual_seed(0)).tolist()
    cached = Engine(model, max_batch=4, prefill_chunk=24, cache_memory=4 * MiB)
    plain = Engine(model, max_batch=4, prefill_chunk=24)
    for seed in (1, 2):  # the second wave finds the first one's blocks
        _same(plain.run_all(_wave(vocab, system, seed)), cached.run_all(_wave(vocab, system, seed)))
    assert sum(r.cached_tokens for r in cached.run_all(_wave(vocab, system, 3))) >= 3 * 2 * BLOCK
    # a second turn resends the first turn's prompt and reply: the reply's blocks are cached too
    first = Request(prompt=system + [5, 6, 7], config=GenerationConfig(max_new_tokens=2 * BLOCK), logprobs=1)
    cached.run_all([first])
    turn = first.prompt + first.output + [9, 10]
    again, fresh = (Request(prompt=turn, config=GenerationConfig(max_new_tokens=8), logprobs=1) for _ in range(2))
    cached.run_all([again])
    plain.run_all([fresh])
    _same([fresh], [again])
    assert again.cached_tokens == (len(first.prompt) + len(first.output) - 1) // BLOCK * BLOCK
    assert again.cached_tokens > len(first.prompt)


def test_prompt_logprobs_requests_prefill_their_whole_prompt(model):
    vocab = model.config.vocab_size
    prompt = torch.randint(0, vocab, (3 * BLOCK + 2,), generator=torch.Generator().manual_seed(4)).tolist()
    engine = Engine(model, cache_memory=4 * MiB)
    engine.run_all([Request(prompt=prompt, config=GenerationConfig(max_new_tokens=2))])
    scored = Request(prompt=prompt, config=GenerationConfig(max_new_tokens=2), prompt_logprobs=0)
    engine.run_all([scored])
    assert scored.cached_tokens == 0 and None not in scored.prompt_token_logprobs[1:]
    assert len(scored.prompt_token_logprobs) == len(prompt)


def test_least_recently_used_blocks_go_first_within_the_budget(model):
    vocab = model.config.vocab_size
    budget = token_bytes(model) * model.config.max_seq_len  # the least the cache takes: one full context
    engine = Engine(model, max_batch=2, prefill_chunk=64, cache_memory=budget)
    gen = torch.Generator().manual_seed(5)
    prompts = [torch.randint(0, vocab, (5 * BLOCK + 1,), generator=gen).tolist() for _ in range(8)]
    engine.run_all([Request(prompt=p, config=GenerationConfig(max_new_tokens=1)) for p in prompts])
    assert engine.prefix.used <= budget
    last, first = (Request(prompt=p, config=GenerationConfig(max_new_tokens=1)) for p in (prompts[-1], prompts[0]))
    engine.run_all([last, first])
    assert last.cached_tokens == 5 * BLOCK and first.cached_tokens == 0  # the oldest prompt was evicted


def test_a_budget_smaller_than_one_request_is_refused(model):
    need = token_bytes(model) * model.config.max_seq_len
    with pytest.raises(GenerationError, match="cannot hold one request.*--cache-memory"):
        Engine(model, cache_memory=need - 1)
    assert isinstance(Engine(model, cache_memory=need).prefix, PrefixCache)
