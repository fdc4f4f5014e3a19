"""lmkit.nn.kernels: one choice of kernels per module, made from its device and dtype when it is built or moved,
never re-made per call; off the CPU only torch's own ops run, and they compute what the CPU kernels compute."""
import pytest
import torch
import torch.nn.functional as F

from helpers.graphs import graph_nodes
from lmkit.config import ModelConfig
from lmkit.models import CausalLM
from lmkit.nn import kernels
from lmkit.nn.kernels import UsesKernels, causal_attention, gelu, select
from lmkit.nn.kernels.rms_norm import rms_norm
from tolerances import assert_close_in

CPU_NODES = ("CausalAttentionBackward", "JoinedCausalAttentionBackward", "_WideLinearBackward", "_GeluTanhBackward",
             "_GeluTanhBiasBackward", "RMSNormFunctionBackward")
CONFIGS = {  # GPT-2's layout (joined attention kernel, GELU with its bias, wide linear) and LLaMA's (rope, RMSNorm)
    "gpt2": dict(position="learned", activation="gelu_tanh"),
    "llama": dict(position="rope", norm="rmsnorm", activation="swiglu", n_kv_heads=2, bias=False),
}


def model_for(name: str) -> CausalLM:
    torch.manual_seed(0)
    config = ModelConfig(vocab_size=64, d_model=64, n_layers=2, n_heads=4, max_seq_len=64, d_ff=256,
                         **CONFIGS[name])
    return CausalLM(config).train()


def choices(model: torch.nn.Module) -> set:
    return {m.kernels for m in model.modules() if isinstance(m, UsesKernels)}


def test_a_module_holds_the_kernels_of_its_device_and_dtype_and_chooses_again_when_moved():
    model = model_for("llama")
    assert choices(model) == {select("cpu", torch.float32)}
    model.to(torch.bfloat16)
    assert choices(model) == {select("cpu", torch.bfloat16)}
    model.float()
    assert choices(model) == {select("cpu", torch.float32)}
    model.to("meta")  # any device but the CPU
    assert choices(model) == {select("meta", torch.float32)}
    assert select("cpu", torch.float32) is select("cpu", torch.float32)  # chosen once per (device, dtype)


@pytest.mark.parametrize("device", ["cuda", "mps", "meta"])
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16, torch.float16])
def test_off_the_cpu_only_torchs_own_ops_are_chosen(monkeypatch, device, dtype):
    chosen = select(device, dtype)
    assert (chosen.attention, chosen.linear, chosen.rms_norm) == (kernels.sdpa_attention, F.linear, rms_norm)
    x = torch.randn(4, 64, 256, requires_grad=True)  # large enough for the compiled GELU on a CPU
    assert chosen.joined_attention(x, lambda h: 1 / 0, 4, 4, 0.125) is None

    def refuse(*args):
        raise AssertionError("a CPU kernel was called")

    monkeypatch.setattr(gelu, "compiled_kernels", refuse)
    monkeypatch.setattr(gelu, "bias_kernels", refuse)
    layer = torch.nn.Linear(256, 256)
    assert torch.equal(chosen.gelu_tanh(x), F.gelu(x, approximate="tanh"))
    assert torch.equal(chosen.gelu_tanh_linear(x, layer), F.gelu(layer(x), approximate="tanh"))


def test_calls_do_not_choose_again(monkeypatch):
    """A training step after the model is built never asks select(): the choice was made at build time."""
    model = model_for("gpt2")

    def refuse(*args, **kwargs):
        raise AssertionError("kernels chosen again during a call")

    monkeypatch.setattr(kernels, "select", refuse)
    monkeypatch.setattr(kernels, "for_module", refuse)
    ids = torch.randint(0, 64, (4, 64), generator=torch.Generator().manual_seed(1))
    model(ids, labels=ids).loss.backward()
    with torch.no_grad():
        model.eval()(ids)


@pytest.mark.parametrize("name", sorted(CONFIGS))
def test_the_other_devices_kernels_give_the_cpu_kernels_numbers(name):
    """The kernels a CUDA or MPS model gets (SDPA and torch's ops), run here on the CPU: the same loss and gradients
    as the CPU kernels, and none of them in the graph."""
    if causal_attention.library() is None or not gelu.bias_kernels():
        pytest.skip("no compiled CPU kernels here (g++ or inductor missing)")
    ids = torch.randint(0, 64, (4, 64), generator=torch.Generator().manual_seed(2))
    results = []
    for device in ("cpu", "cuda"):
        model = model_for(name)
        for m in model.modules():
            if isinstance(m, UsesKernels):
                m.kernels = select(device, torch.float32)
        loss = model(ids, labels=ids).loss
        nodes = graph_nodes(loss)
        grads = torch.autograd.grad(loss, list(model.parameters()))
        results.append((loss, torch.cat([g.reshape(-1) for g in grads]), nodes))
    (cpu_loss, cpu_grads, cpu_nodes), (loss, grads, nodes) = results
    assert not nodes & set(CPU_NODES)
    expected = {"gpt2": {"JoinedCausalAttentionBackward", "_WideLinearBackward", "_GeluTanhBiasBackward"},
                "llama": {"CausalAttentionBackward", "_WideLinearBackward", "RMSNormFunctionBackward"}}[name]
    assert expected <= cpu_nodes
    assert_close_in(torch.float32, loss, cpu_loss, steps=64)
    assert_close_in(torch.float32, grads, cpu_grads, steps=512)
