"""LoRA adapters over HTTP, as vLLM serves them: `--lora NAME=DIR` and POST /v1/load_lora_adapter, each adapter a
model in /v1/models; the openai SDK's requests for the adapters and the base, sent together, answer as the merged
models alone; unknown adapters and bad folders get OpenAI's error body; a repeated prompt reports its cached tokens."""
import concurrent.futures

import pytest
import torch

import lmkit

openai = pytest.importorskip("openai")
httpx = pytest.importorskip("httpx")
pytest.importorskip("fastapi")
pytest.importorskip("transformers")
from helpers.lora_adapters import make_adapter  # noqa: E402
from serving_folders import RunningServer, make_folder  # noqa: E402


@pytest.fixture(scope="module")
def setup(tmp_path_factory):
    root = tmp_path_factory.mktemp("lora")
    folder = make_folder(root / "model", "llama", n_positions=128)
    model, tok = lmkit.load_model(folder), lmkit.load_tokenizer(folder)
    merged = {"a": make_adapter(model, root / "a", 0, ["q_proj", "v_proj"]),
              "b": make_adapter(model, root / "b", 1, ["k_proj", "o_proj", "down_proj"])}
    return folder, root, model, tok, merged


def _greedy(model, tok, prompt: str, n: int) -> str:
    """generate's greedy text up to its first end token, as the server answers it."""
    ids = torch.tensor([tok.encode(prompt)])
    out = model.generate(ids, max_new_tokens=n, do_sample=False)[0, ids.shape[1]:].tolist()
    eos = tok.token_to_id("<|endoftext|>")
    return tok.decode(out[:out.index(eos)] if eos in out else out)


@pytest.mark.parametrize("engine_process", [False, True], ids=["thread", "process"])
def test_adapters_per_request_equal_the_merged_models(setup, engine_process):
    folder, root, model, tok, merged = setup
    prompt = "hello world, this is a small test"
    with RunningServer(folder, max_concurrency=4, loras={"a": str(root / "a")}, cache_memory=8 << 20,
                       engine_process=engine_process) as served:
        client = openai.OpenAI(base_url=served.url + "/v1", api_key="unused", max_retries=0, timeout=60)
        # with the engine in a child, the HTTP process holds the model's skeleton only (its weights on the meta device)
        assert all(p.is_meta for p in served.state.model.parameters()) == engine_process
        cards = {m.id: m for m in client.models.list().data}
        assert set(cards) == {"m", "a"} and cards["a"].parent == "m" and cards["a"].root == str(root / "a")
        answer = httpx.post(served.url + "/v1/load_lora_adapter", json={"lora_name": "b", "lora_path": str(root / "b")})
        assert answer.status_code == 200 and "b" in answer.text

        def ask(name):
            return client.completions.create(model=name, prompt=prompt, max_tokens=8, temperature=0)

        with concurrent.futures.ThreadPoolExecutor(6) as pool:  # adapters and the base in one batch
            answers = list(pool.map(ask, ["m", "a", "b", "a", "m", "b"]))
        for name, answer in zip(["m", "a", "b", "a", "m", "b"], answers):
            reference = model if name == "m" else merged[name]
            assert answer.model == name
            assert answer.choices[0].text == _greedy(reference, tok, prompt, 8)
        assert answers[1].choices[0].text != answers[0].choices[0].text
        again = client.completions.create(model="a", prompt=prompt * 3, max_tokens=2, temperature=0)
        again = client.completions.create(model="a", prompt=prompt * 3, max_tokens=2, temperature=0)
        assert again.usage.prompt_tokens_details.cached_tokens >= 16
        counters = {line.split()[0]: float(line.split()[1]) for line in httpx.get(served.url + "/metrics").text
                    .splitlines() if line.startswith("lmkit_prefix_cache_")}
        # vLLM's counters, in prompt tokens: the repeated prompt's cached tokens are hits (in either engine's place)
        assert counters["lmkit_prefix_cache_hits_total"] >= again.usage.prompt_tokens_details.cached_tokens
        assert counters["lmkit_prefix_cache_queries_total"] > counters["lmkit_prefix_cache_hits_total"]

        with pytest.raises(openai.NotFoundError) as err:
            client.completions.create(model="nope", prompt=prompt, max_tokens=2)
        assert err.value.body["code"] == "model_not_found"
        for body, status in (({"lora_name": "b", "lora_path": str(root / "b")}, 400),  # the name is taken
                             ({"lora_name": "c", "lora_path": str(root / "missing")}, 400),
                             ({"lora_name": "c", "lora_path": str(folder)}, 400),  # a model, not an adapter
                             ({"lora_name": "c"}, 400)):
            answer = httpx.post(served.url + "/v1/load_lora_adapter", json=body)
            assert answer.status_code == status and answer.json()["error"]["message"], body
        assert httpx.post(served.url + "/v1/unload_lora_adapter", json={"lora_name": "b"}).status_code == 200
        assert httpx.post(served.url + "/v1/unload_lora_adapter", json={"lora_name": "b"}).status_code == 404
        with pytest.raises(openai.NotFoundError):
            client.completions.create(model="b", prompt=prompt, max_tokens=2)
        assert {m.id for m in client.models.list().data} == {"m", "a"}
