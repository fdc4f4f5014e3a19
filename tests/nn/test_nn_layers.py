"""Norms, feed-forward networks and residual blocks: the formulas, not just the shapes."""
import math

import pytest
import torch
from torch import nn

from lmkit.config import ModelConfig
from lmkit.nn import FeedForward, LayerNorm, Residual, RMSNorm, build_norm
from tolerances import assert_close_in




def cfg(**kw) -> ModelConfig:
    base = dict(vocab_size=11, d_model=12, n_layers=1, n_heads=3, max_seq_len=16)
    return ModelConfig(**{**base, **kw})


# --- norms -------------------------------------------------------------------------------------

def test_layernorm_of_a_constant_vector_returns_beta():
    torch.manual_seed(0)
    norm = LayerNorm(6)
    nn.init.normal_(norm.weight)
    nn.init.normal_(norm.bias)
    for c in (-3.0, 0.0, 7.5):
        torch.testing.assert_close(norm(torch.full((2, 6), c)), norm.bias.expand(2, 6), rtol=0, atol=1e-6)


def test_layernorm_formula_and_feature_axis_only():
    torch.manual_seed(0)
    norm = LayerNorm(5, eps=1e-5)
    nn.init.normal_(norm.weight)
    nn.init.normal_(norm.bias)
    x = torch.randn(2, 3, 5) * 4 + 1
    mean = x.mean(-1, keepdim=True)
    var = x.var(-1, keepdim=True, unbiased=False)
    torch.testing.assert_close(norm(x), (x - mean) / torch.sqrt(var + 1e-5) * norm.weight + norm.bias)
    # each position is normalized on its own: changing one position leaves the others as they were
    y = x.clone()
    y[1, 2] = 100 * torch.randn(5)
    out_x, out_y = norm(x), norm(y)
    torch.testing.assert_close(out_x[0], out_y[0])
    torch.testing.assert_close(out_x[1, :2], out_y[1, :2])
    plain = LayerNorm(5)
    z = plain(x)
    torch.testing.assert_close(z.mean(-1), torch.zeros(2, 3), atol=1e-6, rtol=0)
    torch.testing.assert_close(z.var(-1, unbiased=False), torch.ones(2, 3), atol=1e-3, rtol=0)


def test_layernorm_without_bias():
    assert LayerNorm(4, bias=False).bias is None
    assert build_norm(cfg(norm_bias=False)).bias is None


def test_rmsnorm_formula_scale_invariance_and_no_centring():
    torch.manual_seed(0)
    norm = RMSNorm(6, eps=1e-6)
    nn.init.normal_(norm.weight)
    x = torch.randn(3, 6)
    expected = x / torch.sqrt(x.pow(2).mean(-1, keepdim=True) + 1e-6) * norm.weight
    torch.testing.assert_close(norm(x), expected)
    torch.testing.assert_close(norm(5.0 * x), norm(x), atol=1e-5, rtol=1e-5)
    const = torch.full((1, 6), 2.0)
    torch.testing.assert_close(norm(const), norm.weight[None], atol=1e-5, rtol=0)  # not beta: no centring


@pytest.mark.bf16
def test_rmsnorm_closed_form_backward():
    """RMSNorm's hand-written backward against finite differences, and against autograd of the formula."""
    from lmkit.nn.kernels.rms_norm import RMSNormFunction, rms_norm

    torch.manual_seed(0)
    x = torch.randn(2, 3, 7, dtype=torch.float64, requires_grad=True)
    weight = torch.randn(7, dtype=torch.float64, requires_grad=True)
    assert torch.autograd.gradcheck(lambda a, w: RMSNormFunction.apply(a, w, 1e-3), (x, weight))
    norm = RMSNorm(7, eps=1e-3).double()
    with torch.no_grad():
        norm.weight.copy_(weight)
    grad = torch.randn(2, 3, 7, dtype=torch.float64)
    got = torch.autograd.grad(norm(x), (x, norm.weight), grad)
    want = torch.autograd.grad(rms_norm(x, weight, 1e-3), (x, weight), grad)
    for a, b in zip(got, want):
        torch.testing.assert_close(a, b, rtol=1e-12, atol=1e-12)
    # bf16 activations (a model cast to bf16): the same numbers as autograd through the float32 formula
    norm16 = RMSNorm(64).bfloat16()
    x16 = (torch.randn(5, 64) * 3).bfloat16().requires_grad_()
    g16 = torch.randn(5, 64).bfloat16()
    got = torch.autograd.grad(norm16(x16), (x16, norm16.weight), g16)
    ref_x = x16.detach().clone().requires_grad_()
    want = torch.autograd.grad(rms_norm(ref_x, norm16.weight, 1e-6), (ref_x, norm16.weight), g16)
    for a, b in zip(got, want):
        assert a.dtype == torch.bfloat16
        assert_close_in(torch.bfloat16, a, b, steps=1)


@pytest.mark.bf16
def test_rmsnorm_computes_in_float32_for_bf16_inputs():
    torch.manual_seed(0)
    norm = RMSNorm(64).bfloat16()
    x = (torch.randn(4, 64) * 300).bfloat16()
    out = norm(x)
    assert out.dtype == torch.bfloat16
    # the mean of squares is taken in float32 (as LLaMA and T5 do), then cast back
    x32 = x.float()
    expected = (x32 * torch.rsqrt(x32.pow(2).mean(-1, keepdim=True) + 1e-6)).bfloat16()
    torch.testing.assert_close(out, expected, atol=0, rtol=0)
    assert isinstance(build_norm(cfg(norm="rmsnorm")), RMSNorm)


# --- feed-forward --------------------------------------------------------------------------------

@pytest.mark.parametrize("activation, fn", [
    ("relu", lambda z: z.clamp(min=0)),
    ("gelu", lambda z: 0.5 * z * (1 + torch.erf(z / math.sqrt(2)))),
    ("gelu_tanh", lambda z: 0.5 * z * (1 + torch.tanh(math.sqrt(2 / math.pi) * (z + 0.044715 * z ** 3)))),
])
def test_plain_ffn_formula(activation, fn):
    torch.manual_seed(0)
    ffn = FeedForward(cfg(activation=activation))
    assert ffn.gate_proj is None
    x = torch.randn(2, 3, 12)
    up = x @ ffn.up_proj.weight.T + ffn.up_proj.bias
    torch.testing.assert_close(ffn(x), fn(up) @ ffn.down_proj.weight.T + ffn.down_proj.bias)


def test_gelu_exact_and_tanh_differ():
    x = torch.randn(2, 3, 12)
    torch.manual_seed(0)
    a = FeedForward(cfg(activation="gelu"))(x)
    torch.manual_seed(0)
    b = FeedForward(cfg(activation="gelu_tanh"))(x)
    assert 0 < (a - b).abs().max() < 1e-2


@pytest.mark.parametrize("activation, fn", [("swiglu", lambda z: z * torch.sigmoid(z)), ("geglu", torch.nn.functional.gelu),
                                            ("reglu", torch.relu)])
def test_gated_ffn_formula(activation, fn):
    torch.manual_seed(0)
    ffn = FeedForward(cfg(activation=activation, bias=False))
    x = torch.randn(2, 3, 12)
    gate, up = x @ ffn.gate_proj.weight.T, x @ ffn.up_proj.weight.T
    torch.testing.assert_close(ffn(x), (fn(gate) * up) @ ffn.down_proj.weight.T)


def test_d_ff_defaults():
    assert cfg(activation="gelu").resolved_d_ff == 48
    assert cfg(d_model=96, activation="swiglu").resolved_d_ff == 256          # 2/3 * 4 * 96 = 256
    assert cfg(d_model=100, n_heads=4, activation="swiglu").resolved_d_ff == 272         # 266.7 rounded up to a multiple of 8
    assert cfg(d_model=100, n_heads=4, activation="swiglu").resolved_d_ff % 8 == 0
    assert cfg(activation="swiglu", d_ff=30).resolved_d_ff == 30
    assert FeedForward(cfg(d_model=96, activation="swiglu")).up_proj.out_features == 256


# --- residual placement --------------------------------------------------------------------------

class Affine(nn.Module):
    """A known sub-layer F(x) = 2x + 1."""

    def forward(self, x):
        return 2 * x + 1


def residual(placement: str, **kw) -> Residual:
    torch.manual_seed(0)
    block = Residual(cfg(norm_placement=placement, **kw), Affine())
    for p in block.parameters():
        nn.init.normal_(p)
    return block


def test_pre_norm_is_x_plus_f_of_norm_x():
    block = residual("pre")
    x = torch.randn(2, 4, 12)
    torch.testing.assert_close(block(x), x + (2 * block.norm(x) + 1))


def test_post_norm_is_norm_of_x_plus_f_x():
    block = residual("post")
    x = torch.randn(2, 4, 12)
    torch.testing.assert_close(block(x), block.norm(x + 2 * x + 1))


def test_sandwich_norm_is_x_plus_norm_of_f_x():
    """Sandwich as the issue defines it: x + LN(F(x)); one norm, on the branch, none before F."""
    block = residual("sandwich")
    assert block.norm is None and block.post_norm is not None
    x = torch.randn(2, 4, 12)
    torch.testing.assert_close(block(x), x + block.post_norm(2 * x + 1))
    # the branch is normalized: an affine change of F that LN removes (F' = 3F) adds the same
    block.sublayer = nn.Sequential(Affine(), nn.Linear(12, 12, bias=False))
    with torch.no_grad():
        block.sublayer[1].weight.copy_(3 * torch.eye(12))
    torch.testing.assert_close(block(x), x + block.post_norm(2 * x + 1), rtol=1e-5, atol=1e-5)
    # and the stream itself is not normalized: x passes through unscaled
    assert not torch.allclose(block(x), block.post_norm(x + 2 * x + 1))


def test_peri_norm_is_x_plus_norm2_of_f_of_norm1_x():
    """Peri (CogView's sandwich-LN, Gemma-2): x + LN'(F(LN(x))), two norms with their own weights.

    Checked: the output equals the formula with both norms, and differs from pre-norm, so the second
    norm is really applied to the branch (the residual path itself stays un-normalized).
    """
    block = residual("peri")
    assert block.post_norm is not None and block.post_norm is not block.norm
    x = torch.randn(2, 4, 12)
    torch.testing.assert_close(block(x), x + block.post_norm(2 * block.norm(x) + 1))
    assert not torch.allclose(block(x), x + (2 * block.norm(x) + 1))
    # the branch is normalized: scaling F's output does not change what gets added
    block.sublayer = nn.Sequential(Affine(), Affine())  # F'(x) = 4x + 3, an affine map of F
    torch.testing.assert_close(block(x) - x, block.post_norm(4 * block.norm(x) + 3))


def test_dropout_acts_in_training_only():
    torch.manual_seed(0)
    block = Residual(cfg(norm_placement="pre", dropout=0.5), nn.Identity())
    x = torch.randn(4, 8, 12)
    block.eval()
    torch.testing.assert_close(block(x), x + block.norm(x))
    block.train()
    branch = block(x) - x
    dropped = branch == 0
    assert 0.3 < dropped.float().mean() < 0.7
    torch.testing.assert_close(branch[~dropped], 2 * block.norm(x)[~dropped])  # kept units scaled by 1/(1-p)
