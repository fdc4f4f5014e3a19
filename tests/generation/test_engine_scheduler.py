"""The engine's per-step token budget (chunked prefill as vLLM schedules it): running streams' next tokens come
first and prompt chunks take what is left, and how a prompt is cut never changes a request's tokens or
log-probabilities."""
import pytest
import torch

import lmkit
from lmkit.generation import GenerationConfig
from lmkit.generation.engine import Engine, Request

pytest.importorskip("transformers")
from serving_folders import make_folder  # noqa: E402


@pytest.fixture(scope="module")
def loaded(tmp_path_factory):
    folder = make_folder(tmp_path_factory.mktemp("llama"), "llama")
    return lmkit.load_model(folder), lmkit.load_tokenizer(folder)


def _requests(vocab: int, count: int = 12) -> list[Request]:
    gen = torch.Generator().manual_seed(3)
    out = []
    for i in range(count):
        prompt = torch.randint(0, vocab, (int(torch.randint(1, 60, (), generator=gen)),), generator=gen).tolist()
        sample = dict(do_sample=True, temperature=0.9, top_k=20) if i % 2 else {}
        config = GenerationConfig(max_new_tokens=int(torch.randint(4, 16, (), generator=gen)), **sample)
        out.append(Request(prompt=prompt, config=config, seed=10 + i, logprobs=2))
    return out


def test_chunking_changes_neither_tokens_nor_logprobs(loaded):
    model, _ = loaded
    whole = Engine(model, max_batch=1, prefill_chunk=10_000).run_all(_requests(model.config.vocab_size))
    for budget, slots in ((7, 4), (13, 12), (64, 3), (10_000, 12)):  # the last: every prompt in one padded forward
        chunked = Engine(model, max_batch=slots, prefill_chunk=budget).run_all(_requests(model.config.vocab_size))
        for a, b in zip(whole, chunked):
            assert a.output == b.output, budget
            assert torch.allclose(torch.tensor(a.token_logprobs), torch.tensor(b.token_logprobs), atol=1e-5)


def test_decodes_and_prompt_chunks_share_the_step_budget(loaded):
    model, _ = loaded
    budget = 9
    engine = Engine(model, max_batch=6, prefill_chunk=budget)
    requests = _requests(model.config.vocab_size, 10)
    for request in requests[:3]:
        engine.submit(request)
    step_tokens: list[int] = []
    widest: list[int] = []  # requests prefilled in one step (one left-padded forward)
    prefill, decode = engine._prefill, engine._decode

    def counted_prefill(chunks):
        step_tokens[-1] += sum(count for _, count in chunks)
        widest.append(len(chunks))
        prefill(chunks)

    def counted_decode(rows):
        step_tokens[-1] += len(rows)
        decode(rows)

    engine._prefill, engine._decode = counted_prefill, counted_decode
    late = iter(requests[3:])
    while not all(r.finished for r in requests):
        step_tokens.append(0)
        engine.step()
        arrival = next(late, None)  # a request arrives after every step while the others decode
        if arrival is not None:
            engine.submit(arrival)
    assert max(step_tokens) <= max(budget, engine.max_batch) and max(widest) > 1
    assert sum(step_tokens) == sum(len(r.prompt) + len(r.output) - 1 for r in requests)
