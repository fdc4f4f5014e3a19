"""quick_gelu: the texts' GELU approximation x * sigmoid(1.702 x), as transformers' ACT2FN["quick_gelu"]."""
import math

import torch
from transformers.activations import ACT2FN

from lmkit.config import ModelConfig
from lmkit.nn.ffn import FeedForward, activation


def test_quick_gelu_is_the_sigmoid_formula_and_transformers_function():
    x = torch.linspace(-8, 8, 2001, dtype=torch.float64)
    ours = activation("quick_gelu")(x)
    assert torch.allclose(ours, x / (1 + torch.exp(-1.702 * x)), atol=1e-15)
    assert torch.allclose(ours, ACT2FN["quick_gelu"](x), atol=1e-15)


def test_quick_gelu_error_against_exact_gelu_is_small_and_measured():
    """The approximation differs from x * Phi(x) by at most ~0.02 (near |x| = 2), and not at 0 or far out."""
    x = torch.linspace(-10, 10, 20001, dtype=torch.float64)
    exact = 0.5 * x * (1 + torch.erf(x / math.sqrt(2)))
    err = (activation("quick_gelu")(x) - exact).abs()
    assert 0.015 < err.max().item() < 0.025
    assert err[x.abs() > 8].max() < 1e-4 and err[10000].item() < 1e-30  # x = 0
    tanh_err = (activation("gelu_tanh")(x) - exact).abs().max().item()
    assert tanh_err < err.max().item() / 10  # the tanh form is the closer of the two


def test_a_quick_gelu_config_runs_its_activation():
    cfg = ModelConfig(d_model=8, n_heads=2, n_layers=1, vocab_size=16, activation="quick_gelu", d_ff=12)
    ffn = FeedForward(cfg).eval()
    x = torch.randn(2, 3, 8)
    h = ffn.up_proj(x)
    assert torch.allclose(ffn(x), ffn.down_proj(h * torch.sigmoid(1.702 * h)), atol=1e-6)
