"""`lmkit serve --engine-process`: the engine steps in a child process. Answers equal model.generate alone (greedy,
seeded, n choices, logprobs, a grammar); a SIGKILL of the engine process mid-stream gives the stream in flight and
the requests waiting a 503 (an error event on the stream), never a hang or a 500, and a fresh engine serves again."""
import json
import os
import signal
import threading
import time

import pytest
import torch

import lmkit

openai = pytest.importorskip("openai")
httpx = pytest.importorskip("httpx")
pytest.importorskip("fastapi")
pytest.importorskip("uvicorn")
pytest.importorskip("transformers")
from serving_folders import RunningServer, generate_ids, make_folder, reply_text  # noqa: E402


@pytest.fixture(scope="module")
def folder(tmp_path_factory):
    return make_folder(tmp_path_factory.mktemp("served"), "llama", n_positions=512, width=64)


@pytest.fixture(scope="module")
def served(folder):
    with RunningServer(folder, max_concurrency=4, max_queue=8, prefill_chunk=16, engine_process=True) as server:
        yield server


@pytest.fixture(scope="module")
def client(served):
    return openai.OpenAI(base_url=served.url + "/v1", api_key="unused", max_retries=0, timeout=60)


@pytest.fixture(scope="module")
def local(folder):  # the model and tokenizer as generate runs them alone
    return lmkit.load_model(folder), lmkit.load_tokenizer(folder)


_generate, _text = generate_ids, reply_text


def test_answers_equal_generate(client, served, local):
    model, tok = local
    assert served.state.engine.pid != os.getpid()
    prompts = ["hello world", "naïve café"]
    greedy = client.completions.create(model="m", prompt=prompts, max_tokens=9, temperature=0, logprobs=2)
    for choice in greedy.choices:
        ids = tok.encode(prompts[choice.index])
        expected = _generate(local, ids, max_new_tokens=9)
        assert choice.text == _text(local, expected)
        with torch.no_grad():  # each token's log-probability: the model's log-softmax at its position
            logits = model(torch.tensor([ids + expected])).logits[0, len(ids) - 1:-1].float()
        wanted = torch.log_softmax(logits, -1)[torch.arange(len(expected)), torch.tensor(expected)]
        assert torch.allclose(torch.tensor(choice.logprobs.token_logprobs), wanted, atol=1e-4)
    ids = tok.encode("The quick")
    several = client.completions.create(model="m", prompt="The quick", max_tokens=10, temperature=1.1, n=3, seed=5)
    torch.manual_seed(5)  # n choices with a seed: the rows of generate(num_return_sequences=n) after that seed
    rows = model.generate(torch.tensor([ids]), max_new_tokens=10, do_sample=True, temperature=1.1, top_k=0,
                          num_return_sequences=3)
    assert [c.text for c in sorted(several.choices, key=lambda c: c.index)] == [
        _text(local, row[len(ids):].tolist()) for row in rows]
    streamed = "".join(c.choices[0].text for c in client.completions.create(
        model="m", prompt="def f(x):", max_tokens=12, temperature=0.8, seed=3, stream=True) if c.choices)
    assert streamed == _text(local, _generate(local, tok.encode("def f(x):"), seed=3, max_new_tokens=12,
                                              do_sample=True, temperature=0.8, top_k=0))


def test_grammar_in_the_engine_process(client):
    pytest.importorskip("xgrammar")
    answer = client.completions.create(model="m", prompt="pick:", max_tokens=20, temperature=1.0, seed=1,
                                       extra_body={"guided_choice": ["yes", "no", "maybe"]})
    assert answer.choices[0].text in ("yes", "no", "maybe")


def _stream_lines(url, body, lines: list, first: threading.Event):
    with httpx.stream("POST", url + "/v1/completions", json=body, timeout=60) as response:
        lines.append(response.status_code)
        for line in response.iter_lines():
            if line:
                lines.append(line)
                first.set()
    first.set()


def test_sigkill_mid_stream_is_503_then_served_again(served, local):
    engine, url = served.state.engine, served.url
    old = engine.pid
    lines, first = [], threading.Event()
    body = {"model": "m", "prompt": "hello", "max_tokens": 480, "temperature": 0, "ignore_eos": True, "stream": True}
    reader = threading.Thread(target=_stream_lines, args=(url, body, lines, first))
    reader.start()
    assert first.wait(60)
    os.kill(old, signal.SIGSTOP)  # the stream is mid-way; stopped, the engine cannot finish it before the kill
    waiting = {}

    def plain():
        waiting["response"] = httpx.post(url + "/v1/completions", json={"model": "m", "prompt": "hi", "max_tokens": 5},
                                         timeout=60)

    other = threading.Thread(target=plain)
    other.start()
    deadline = time.monotonic() + 30
    while len(engine.live) < 2 and time.monotonic() < deadline:  # the second request is sent to the stopped engine
        time.sleep(0.01)
    assert len(engine.live) == 2
    os.kill(old, signal.SIGKILL)
    reader.join(60), other.join(60)
    assert not reader.is_alive() and not other.is_alive()
    assert lines[0] == 200
    events = [json.loads(line[len("data: "):]) for line in lines[1:] if line != "data: [DONE]"]
    assert any(e.get("choices") and e["choices"][0]["text"] for e in events)  # tokens came before the crash
    assert events[-1]["error"]["code"] == 503 and lines[-1] == "data: [DONE]"
    response = waiting["response"]
    assert response.status_code == 503 and response.json()["error"]["code"] == "engine_failed"
    assert response.headers["retry-after"] == "1"
    statuses = set()
    deadline = time.monotonic() + 120
    while time.monotonic() < deadline:  # while the fresh engine loads: 503 with Retry-After, never a 500 or a hang
        answer = httpx.post(url + "/v1/completions", json={"model": "m", "prompt": "hello world", "max_tokens": 6,
                                                           "temperature": 0}, timeout=60)
        statuses.add(answer.status_code)
        if answer.status_code == 200:
            break
        assert answer.json()["error"]["type"] == "service_unavailable"
        time.sleep(0.05)
    assert statuses <= {200, 503} and 200 in statuses
    assert engine.pid != old and engine.restarts == 1
    _, tok = local
    assert answer.json()["choices"][0]["text"] == _text(local, _generate(local, tok.encode("hello world"),
                                                                         max_new_tokens=6))
