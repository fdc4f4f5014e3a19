"""Decoding on a CUDA device: greedy ids equal the CPU's (and transformers' on the same GPU), the serving engine and
`lmkit serve --device cuda` answer what generate answers, `lmkit generate --device cuda` prints what the CPU
prints; sentence embeddings and the logit lens read the same numbers."""
import pytest
import torch

import lmkit
from lmkit.cli import main
from lmkit.device import module_device
from lmkit.generation import GenerationConfig
from lmkit.generation.engine import Engine, Request

transformers = pytest.importorskip("transformers")
from helpers.hf_folders import build  # noqa: E402
from serving_folders import RunningServer, make_folder  # noqa: E402

CUDA = torch.device("cuda", 0)


@pytest.fixture(scope="module", params=["gpt2", "llama"])
def folder(request, tmp_path_factory):
    return build(request.param, tmp_path_factory.mktemp(request.param))


@pytest.fixture(scope="module")
def prompts():
    return torch.tensor([[5, 17, 42, 8, 99, 3], [7, 7, 120, 64, 2, 31]])


@pytest.mark.parametrize("settings", [dict(), dict(num_beams=3), dict(repetition_penalty=1.3, no_repeat_ngram_size=2)])
def test_greedy_ids_on_cuda_equal_the_cpu_and_transformers(folder, prompts, settings):
    cpu = lmkit.load_model(folder)
    gpu = lmkit.load_model(folder, device="cuda")
    assert module_device(gpu) == CUDA
    settings = dict(settings, max_new_tokens=12, do_sample=False, pad_token_id=0)
    want = cpu.generate(prompts, **settings)
    got = gpu.generate(prompts, **settings)  # ids on the host: moved to the GPU
    assert got.device == CUDA  # as transformers returns them: where the model is
    assert torch.equal(got.cpu(), want)
    hf = transformers.AutoModelForCausalLM.from_pretrained(folder).to(CUDA).eval()
    theirs = hf.generate(prompts.to(CUDA), attention_mask=torch.ones_like(prompts, device=CUDA), **settings)
    assert torch.equal(got, theirs)


def test_sampling_on_cuda_runs_with_the_processors(folder, prompts):
    gpu = lmkit.load_model(folder, device="cuda")
    torch.manual_seed(0)
    out = gpu.generate(prompts, max_new_tokens=10, do_sample=True, temperature=0.8, top_k=20, top_p=0.9, min_p=0.02,
                       repetition_penalty=1.2, num_return_sequences=2)
    assert out.shape == (4, prompts.shape[1] + 10) and int(out.max()) < gpu.config.vocab_size


def test_the_engine_on_cuda_answers_what_generate_answers(tmp_path):
    folder = make_folder(tmp_path, "llama")
    model, tok = lmkit.load_model(folder), lmkit.load_tokenizer(folder)
    engine = Engine(model, max_batch=3, prefill_chunk=5, device="cuda")
    assert engine.device == CUDA
    prompts = [tok.encode(t) for t in ("hello world", "def f(x):", "The quick brown fox", "stop here")]
    requests = [Request(prompt=p, config=GenerationConfig(max_new_tokens=8)) for p in prompts]
    engine.run_all(requests)
    for p, request in zip(prompts, requests):
        alone = model.generate(torch.tensor([p]), max_new_tokens=8)  # on the CPU
        assert request.output == alone[0, len(p):].tolist()


def test_generate_cli_on_cuda_prints_what_the_cpu_prints(tmp_path, capsys):
    folder = make_folder(tmp_path, "gpt2")
    printed = []
    for device in ("cpu", "cuda"):
        assert main(["generate", "--model", str(folder), "--prompt", "hello world", "--max-new-tokens", "12",
                     "--device", device]) == 0
        printed.append(capsys.readouterr().out)
    assert printed[0] == printed[1]


def test_serve_on_cuda_answers_what_generate_answers(tmp_path):
    httpx = pytest.importorskip("httpx")
    pytest.importorskip("uvicorn")
    folder = make_folder(tmp_path, "llama", n_positions=128)
    model, tok = lmkit.load_model(folder), lmkit.load_tokenizer(folder)
    ids = tok.encode("hello world")
    new = model.generate(torch.tensor([ids]), max_new_tokens=9)[0, len(ids):].tolist()
    want = tok.decode([i for i in new if i != model.config.eos_token_id])
    with RunningServer(folder, device="cuda") as served:
        assert module_device(served.state.model) == CUDA
        r = httpx.post(served.url + "/v1/completions", timeout=60,
                       json={"model": "m", "prompt": "hello world", "max_tokens": 9, "temperature": 0})
    assert r.status_code == 200, r.text
    assert r.json()["choices"][0]["text"] == want


def test_sentence_embeddings_on_cuda(minilm_path):
    sentences = ["A man is eating food.", "The new movie is awesome", "def f(x): return x"]
    cpu = lmkit.SentenceEncoder.from_pretrained(minilm_path).encode(sentences)
    encoder = lmkit.SentenceEncoder.from_pretrained(minilm_path, device="cuda")
    assert module_device(encoder.model) == CUDA
    assert abs(encoder.encode(sentences) - cpu).max() < 1e-5


def test_the_logit_lens_on_cuda_reads_the_cpu_numbers(tmp_path):
    from lmkit.lens import logit_lens

    folder = make_folder(tmp_path, "gpt2")
    ids = torch.tensor(lmkit.load_tokenizer(folder).encode("The quick brown fox"))
    cpu = logit_lens(lmkit.load_model(folder), ids)
    gpu = logit_lens(lmkit.load_model(folder, device="cuda"), ids)
    torch.testing.assert_close(gpu.logits, cpu.logits, rtol=1e-4, atol=1e-4)
