"""QLoRA's NF4 and double quantization against the paper's table and bitsandbytes (which runs on CPU)."""
import pytest
import torch
from torch import nn

from lmkit.errors import ConfigError
from lmkit.peft.quant import QuantizedLinear, blockwise_quantize, double_quantize, dynamic_map, nf4_levels

bnb = pytest.importorskip("bitsandbytes")
from bitsandbytes import functional as BF  # noqa: E402

# Dettmers et al. 2023, appendix E: the NF4 data type's 16 values
QLORA_TABLE = [-1.0, -0.6961928009986877, -0.5250730514526367, -0.39491748809814453, -0.28444138169288635,
               -0.18477343022823334, -0.09105003625154495, 0.0, 0.07958029955625534, 0.16093020141124725,
               0.24611230194568634, 0.33791524171829224, 0.44070982933044434, 0.5626170039176941,
               0.7229568362236023, 1.0]


def test_nf4_levels_are_the_papers_table_and_bitsandbytes_code():
    assert nf4_levels().tolist() == pytest.approx(QLORA_TABLE, abs=0, rel=0)
    assert torch.equal(nf4_levels(), BF.get_4bit_type("nf4", device="cpu")[:16])


@pytest.mark.parametrize("shape", [(7, 192), (33, 64), (5, 320), (130, 640)])
def test_blockwise_nf4_equals_bitsandbytes_quantize_and_dequantize_4bit(shape):
    torch.manual_seed(sum(shape))
    w = torch.randn(shape) * torch.rand(shape[0], 1) * 3  # rows of different scales
    w[0, :5] = 0.0
    ours = QuantizedLinear(_linear(w), 4, 64)
    packed, state = BF.quantize_4bit(w, blocksize=64, quant_type="nf4")
    assert torch.equal(ours.qweight, packed.view(-1)), "the packed indices (two a byte, high nibble first)"
    assert torch.equal(ours.scales, state.absmax)
    assert torch.equal(ours.dequantize(), BF.dequantize_4bit(packed, state))


def _linear(w: torch.Tensor) -> nn.Linear:
    layer = nn.Linear(w.shape[1], w.shape[0], bias=False)
    layer.weight.data = w.clone()
    return layer


def test_the_dynamic_8bit_code_and_blockwise_8bit_equal_bitsandbytes():
    assert torch.equal(dynamic_map(), BF.create_dynamic_map(signed=True))
    # bitsandbytes' reference kernel (its pure-torch "default" backend, bucketize over the code's midpoints); its
    # native CPU kernel's approximate binary search picks the farther neighbour for a few values in a thousand
    reference = torch.ops.bitsandbytes.quantize_blockwise.default
    keys = torch._C.DispatchKeySet("CompositeExplicitAutograd")
    torch.manual_seed(1)
    for n in (7, 256, 1000, 20011):
        x = torch.randn(n) * torch.rand(n) ** 3
        want_q, want_absmax = reference.redispatch(keys, x, dynamic_map(), 256)
        got_q, got_absmax = blockwise_quantize(x, dynamic_map(), 256)
        assert torch.equal(got_q, want_q) and torch.equal(got_absmax, want_absmax), n


def test_double_quantization_is_qloras_and_saves_its_bits_per_parameter():
    torch.manual_seed(2)
    w = torch.randn(300, 64 * 9) * torch.rand(300, 1) * 2
    packed, state = BF.quantize_4bit(w, blocksize=64, quant_type="nf4", compress_statistics=True)
    plain = QuantizedLinear(_linear(w), 4, 64)
    dq = QuantizedLinear(_linear(w), 4, 64, double_quant=True)
    codes, absmax, offset = double_quantize(plain.scales)
    assert offset == pytest.approx(plain.scales.mean().item(), rel=1e-7) and state.offset.item() == pytest.approx(offset)
    assert torch.equal(dq.qweight, packed.view(-1)) and torch.equal(absmax, state.state2.absmax)
    # the scales come back within half a step of the 8-bit code around each value
    restored = dq.block_scales()
    step = (dynamic_map()[1:] - dynamic_map()[:-1]).max() * absmax.max()
    assert (restored - plain.scales).abs().max() <= step / 2 + 1e-6
    assert (codes != state.absmax).float().mean() < 0.02  # bitsandbytes' native search differs on a few
    # bits per parameter: 4 + 32/64 = 4.5 plain; 4 + 8/64 + 32/(64 * 256) with DQ: the paper's 0.373 saved
    params = w.numel()
    assert plain.storage_bytes() * 8 / params == pytest.approx(4.5)
    saved = (plain.storage_bytes() - dq.storage_bytes()) * 8 / params
    assert saved == pytest.approx(8 * (4 - 1) / 64 - 32 / (64 * 256), abs=0.002)  # 0.373 (the offset aside)
    x = torch.randn(3, 64 * 9)
    assert torch.allclose(dq(x), x @ dq.dequantize().T) and (dq.dequantize() - w).abs().max() < w.abs().max() / 4


def test_double_quantization_needs_nf4():
    with pytest.raises(ConfigError, match="NF4"):
        QuantizedLinear(_linear(torch.randn(4, 64)), 8, 64, double_quant=True)
