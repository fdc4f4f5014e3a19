"""`lmkit serve` on a Mistral folder whose sliding window (6) is shorter than prompt + output: served through the
engine, the openai SDK's completions (greedy, seeded, streamed, with logprobs) equal `generate` alone."""
import pytest
import torch

import lmkit

openai = pytest.importorskip("openai")
pytest.importorskip("fastapi")
pytest.importorskip("uvicorn")
pytest.importorskip("transformers")
from serving_folders import RunningServer, generate_ids, make_folder, reply_text  # noqa: E402


@pytest.fixture(scope="module")
def folder(tmp_path_factory):
    return make_folder(tmp_path_factory.mktemp("mistral"), "mistral", n_positions=128, sliding_window=6)


@pytest.fixture(scope="module")
def local(folder):
    return lmkit.load_model(folder), lmkit.load_tokenizer(folder)


@pytest.mark.parametrize("mode", ["thread", "process"])
def test_sliding_window_folder_is_served_by_the_engine(folder, local, mode):
    model, tok = local
    assert model.config.sliding_window == 6
    prompts = ["hello world, this is a small test", "def f(x):", "The quick brown fox jumps over the lazy dog."]
    with RunningServer(folder, max_concurrency=4, prefill_chunk=5, engine_process=mode == "process") as server:
        from lmkit.generation.engine import Engine

        assert mode == "process" or isinstance(server.state.engine, Engine)
        client = openai.OpenAI(base_url=server.url + "/v1", api_key="unused", max_retries=0, timeout=60)
        greedy = client.completions.create(model="m", prompt=prompts, max_tokens=12, temperature=0, logprobs=0)
        seeded = client.completions.create(model="m", prompt=prompts[2], max_tokens=10, temperature=0.9, seed=3)
        stream = client.completions.create(model="m", prompt=prompts[0], max_tokens=12, temperature=0, stream=True)
        streamed = "".join(chunk.choices[0].text for chunk in stream)
    for choice in greedy.choices:
        ids = tok.encode(prompts[choice.index])
        out = model.generate(torch.tensor([ids]), max_new_tokens=12, return_dict_in_generate=True, output_logits=True)
        new = out.sequences[0, len(ids):].tolist()
        assert choice.text == reply_text(local, new)
        expected = [float(torch.log_softmax(step[0], -1)[t]) for step, t in zip(out.logits, new)]
        assert choice.logprobs.token_logprobs == pytest.approx(expected, abs=1e-4)
    ids = tok.encode(prompts[2])
    assert seeded.choices[0].text == reply_text(local, generate_ids(local, ids, seed=3, max_new_tokens=10,
                                                                    do_sample=True, temperature=0.9, top_k=0))
    assert streamed == greedy.choices[0].text
