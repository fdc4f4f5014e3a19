"""LoRA adapters per request: rows for different adapters and for the base model decode in one batch, each as the
merged model (W + s B A) alone decodes it; adapters that do not fit are refused."""
import pytest
import torch

import lmkit
from lmkit.errors import GenerationError
from lmkit.generation import GenerationConfig
from lmkit.generation.engine import Engine, Request
from lmkit.peft import lora_weights

pytest.importorskip("transformers")
from helpers.lora_adapters import make_adapter  # noqa: E402
from serving_folders import make_folder  # noqa: E402


@pytest.fixture(scope="module", params=["gpt2", "llama"])
def served(request, tmp_path_factory):
    root = tmp_path_factory.mktemp(request.param)
    model = lmkit.load_model(make_folder(root / "model", request.param))
    targets = {"a": ["q_proj", "v_proj"], "b": ["q_proj", "k_proj", "v_proj", "o_proj", "up_proj", "down_proj"]}
    merged = {name: make_adapter(model, root / name, seed, modules)
              for seed, (name, modules) in enumerate(targets.items())}
    return model, root, merged


def _alone(model, request):
    torch.manual_seed(request.seed)
    return model.generate(torch.tensor([request.prompt]), generation_config=request.config)[0, len(request.prompt):]


def test_mixed_adapters_in_one_batch_equal_the_merged_models(served):
    model, root, merged = served
    engine = Engine(model, max_batch=6, prefill_chunk=16, cache_memory=4 << 20)
    for name in merged:
        engine.add_adapter(name, lora_weights(engine.adapters.bare, root / name))
    gen = torch.Generator().manual_seed(7)
    system = torch.randint(0, model.config.vocab_size, (20,), generator=gen).tolist()
    requests = []
    for i in range(12):
        suffix = torch.randint(0, model.config.vocab_size, (int(torch.randint(1, 20, (), generator=gen)),),
                               generator=gen).tolist()
        sample = dict(do_sample=True, top_k=10) if i % 2 else {}
        # one system prompt for all: the prefix cache must keep each adapter's keys and values apart
        requests.append(Request(prompt=system + suffix, seed=i, adapter=[None, "a", "b"][i % 3], logprobs=0,
                                config=GenerationConfig(max_new_tokens=10, **sample)))
    engine.run_all(requests)
    for request in requests:
        reference = model if request.adapter is None else merged[request.adapter]
        assert request.output == _alone(reference, request).tolist(), request.adapter
    assert {r.adapter for r in requests if r.cached_tokens} == {None, "a", "b"}
    outputs = {r.adapter: r.output for r in requests}
    assert len({tuple(o) for o in outputs.values()}) == 3  # the adapters really change the tokens


def test_unknown_and_unfitting_adapters_are_refused(served):
    model, root, _ = served
    engine = Engine(model)
    with pytest.raises(GenerationError, match="no adapter named 'x'"):
        engine.submit(Request(prompt=[1, 2], adapter="x"))
    weights = lora_weights(model, root / "a")
    name, (A, B, s) = next(iter(weights.items()))
    with pytest.raises(GenerationError, match="does not fit"):
        engine.add_adapter("bad", {name: (A[:, :-1], B, s)})
    engine.add_adapter("a", weights)
    with pytest.raises(GenerationError, match="loaded already"):
        engine.add_adapter("a", weights)
    engine.remove_adapter("a")
    with pytest.raises(GenerationError, match="no adapter named 'a'"):
        engine.submit(Request(prompt=[1, 2], adapter="a"))
