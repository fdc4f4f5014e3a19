"""Presence and frequency penalties against OpenAI's documented formula
logit_t - c_t * frequency_penalty - [c_t > 0] * presence_penalty (c_t: the count of token t in the output so far,
the prompt not counted, as vLLM counts it), through the engine's Python API and the server with the openai SDK."""
import pytest
import torch

import lmkit
from lmkit.generation import GenerationConfig
from lmkit.generation.engine import Engine, Request
from lmkit.generation.logits import count_penalties

openai = pytest.importorskip("openai")
pytest.importorskip("fastapi")
pytest.importorskip("uvicorn")
from serving_folders import RunningServer, make_folder  # noqa: E402

PENALTIES = [(0.0, 1.5), (1.5, 0.0), (0.7, 0.9), (-1.0, -0.5)]


def _reference(model, prompt: list[int], n: int, presence: float, frequency: float, eos: int | None = None) -> list[int]:
    """Greedy decoding by the formula, one full forward a token, written out independently of lmkit's processors
    (ending after `eos`, which the text leaves out)."""
    out: list[int] = []
    for _ in range(n):
        with torch.no_grad():
            logits = model(torch.tensor([prompt + out])).logits[0, -1].double()
        for t in set(out):
            c = out.count(t)
            logits[t] -= c * frequency + presence
        out.append(int(logits.argmax()))
        if out[-1] == eos:
            return out[:-1]
    return out


@pytest.fixture(scope="module")
def folder(tmp_path_factory):
    return make_folder(tmp_path_factory.mktemp("penalties"), "llama", n_positions=128)


@pytest.fixture(scope="module")
def local(folder):
    return lmkit.load_model(folder), lmkit.load_tokenizer(folder)


def test_count_penalties_is_the_formula_on_random_logits():
    torch.manual_seed(0)
    scores = torch.randn(1, 11, dtype=torch.float64)
    output = [3, 3, 7, 3, 0, 10, 7]
    got = count_penalties(scores, output, presence=0.4, frequency=0.25)
    want = scores.clone()
    for t in set(output):
        want[0, t] -= output.count(t) * 0.25 + 0.4
    assert torch.allclose(got, want, rtol=0, atol=1e-12) and not torch.allclose(got, scores)
    assert torch.equal(count_penalties(scores, [], 0.4, 0.25), scores)


@pytest.mark.parametrize("presence,frequency", PENALTIES)
def test_engine_greedy_with_penalties_equals_the_formula(local, presence, frequency):
    model, tok = local
    prompt = tok.encode("the the the the cat")
    engine = Engine(model, max_batch=2)
    cfg = GenerationConfig(max_new_tokens=12, do_sample=False, eos_token_id=None)
    request = Request(prompt, config=cfg, presence_penalty=presence, frequency_penalty=frequency)
    engine.run_all([request])
    assert request.output == _reference(model, prompt, 12, presence, frequency)


def test_penalties_change_the_answer_of_a_repetitive_model(local):
    """A random model repeats itself greedily; a strong frequency penalty breaks the loop (so the test can fail)."""
    model, tok = local
    prompt = tok.encode("the the the the cat")
    plain, penalised = _reference(model, prompt, 12, 0, 0), _reference(model, prompt, 12, 0, 2.0)
    assert plain != penalised
    assert max(penalised.count(t) for t in penalised) < max(plain.count(t) for t in plain)


def test_server_applies_penalties_as_openai_documents(folder, local):
    model, tok = local
    prompt = "the the the the cat"
    ids = tok.encode(prompt)
    with RunningServer(folder, max_concurrency=4) as served:
        client = openai.OpenAI(base_url=served.url + "/v1", api_key="unused", max_retries=0, timeout=60)
        for presence, frequency in PENALTIES:
            answer = client.completions.create(model="m", prompt=prompt, max_tokens=10, temperature=0,
                                               presence_penalty=presence, frequency_penalty=frequency)
            want = _reference(model, ids, 10, presence, frequency, model.config.eos_token_id)
            assert answer.choices[0].text == tok.decode(want), (presence, frequency)
        with pytest.raises(openai.BadRequestError):
            client.completions.create(model="m", prompt=prompt, max_tokens=2, frequency_penalty=2.5)
