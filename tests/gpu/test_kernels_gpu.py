"""The kernel dispatch on a GPU: a model moved to CUDA takes SDPA and torch's ops, never the CPU kernels, and
trains to the CPU's numbers. Skipped without CUDA."""
import pytest
import torch

from helpers.graphs import graph_nodes
from lmkit.config import ModelConfig
from lmkit.models import CausalLM
from lmkit.nn.kernels import UsesKernels, select

pytestmark = pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU")

CPU_NODES = {"CausalAttentionBackward", "JoinedCausalAttentionBackward", "_WideLinearBackward", "_GeluTanhBackward",
             "_GeluTanhBiasBackward", "RMSNormFunctionBackward"}


@pytest.mark.parametrize("layout", [dict(position="learned", activation="gelu_tanh"),
                                    dict(position="rope", norm="rmsnorm", activation="swiglu", n_kv_heads=2)])
def test_a_model_moved_to_cuda_trains_through_torchs_ops_to_the_cpus_numbers(layout):
    torch.manual_seed(0)
    config = ModelConfig(vocab_size=64, d_model=64, n_layers=2, n_heads=4, max_seq_len=64, d_ff=256, **layout)
    cpu = CausalLM(config).train()
    gpu = CausalLM(config).train()
    gpu.load_state_dict(cpu.state_dict())
    gpu.to("cuda")
    assert {m.kernels for m in gpu.modules() if isinstance(m, UsesKernels)} == {select("cuda", torch.float32)}
    ids = torch.randint(0, 64, (4, 64), generator=torch.Generator().manual_seed(1))
    want = cpu(ids, labels=ids).loss
    want_grads = torch.autograd.grad(want, list(cpu.parameters()))
    previous = torch.backends.cuda.matmul.allow_tf32
    torch.backends.cuda.matmul.allow_tf32 = False  # float32 products, as on the CPU
    try:
        got = gpu(ids.cuda(), labels=ids.cuda()).loss
        assert not graph_nodes(got) & CPU_NODES
        got_grads = torch.autograd.grad(got, list(gpu.parameters()))
    finally:
        torch.backends.cuda.matmul.allow_tf32 = previous
    torch.testing.assert_close(got.cpu(), want, rtol=1e-4, atol=1e-5)
    for g, w in zip(got_grads, want_grads):
        torch.testing.assert_close(g.cpu(), w, rtol=1e-3, atol=1e-5)
    gpu.cpu()
    assert {m.kernels for m in gpu.modules() if isinstance(m, UsesKernels)} == {select("cpu", torch.float32)}
