"""lmkit.nn.dropout: the cheap CPU mask is Bernoulli(1 - p) per entry, independent, seeded, and inverted-scaled;
`activation_dropout` is the FFN's inner dropout, apart from `dropout` (GPT-2, BERT and LLaMA have none inside)."""
import math

import pytest
import torch

from lmkit.config import ModelConfig
from lmkit.nn import FeedForward
from lmkit.nn.dropout import Dropout, dropout, keep_mask

N = 1 << 20


def within(count: float, n: int, q: float) -> bool:
    """count of a Binomial(n, q) draw within 5 standard deviations of n q."""
    return abs(count - n * q) < 5 * math.sqrt(n * q * (1 - q))


@pytest.mark.parametrize("p", [0.1, 0.5, 0.9, 1e-4])
def test_each_entry_is_dropped_with_probability_p(p):
    torch.manual_seed(0)
    keep = keep_mask(torch.Size([N]), p)
    assert keep.dtype == torch.bool and keep.shape == (N,)
    assert within(int((~keep).sum()), N, p)
    for lane in range(4):  # every 16-bit word of a 64-bit draw is fair (a signed draw's top word is not)
        assert within(int((~keep[lane::4]).sum()), N // 4, p)


def test_entries_are_independent():
    torch.manual_seed(1)
    p = 0.3
    drop = ~keep_mask(torch.Size([N]), p)
    for gap in (1, 2, 3, 4, 5, 8, 64):  # neighbours inside one 64-bit draw, across draws
        both = int((drop[:-gap] & drop[gap:]).sum())
        assert within(both, N - gap, p * p), gap


def test_inverted_scaling_zeroes_or_scales_and_keeps_the_mean():
    torch.manual_seed(2)
    x = torch.randn(64, 32, 512)
    y = dropout(x, 0.25)
    kept = y != 0
    torch.testing.assert_close(y[kept], x[kept] / 0.75)
    assert abs(y.mean() - x.mean()) < 5 * x.std() / math.sqrt(x.numel() * 0.75)


def test_gradient_is_the_same_mask_scaled():
    torch.manual_seed(3)
    x = torch.randn(8, 16, 40, requires_grad=True)
    y = dropout(x, 0.375)  # p 2^16 is a whole number: p' = p
    y.backward(torch.ones_like(y))
    kept = y.detach() != 0
    torch.testing.assert_close(x.grad, kept.float() / 0.625)


@pytest.mark.bf16
def test_seeded_like_torch_and_off_in_eval_and_at_zero():
    x = torch.randn(4, 8, 24, dtype=torch.bfloat16)
    torch.manual_seed(4)
    a = dropout(x, 0.1)
    torch.manual_seed(4)
    b = dropout(x, 0.1)
    assert torch.equal(a, b) and a.dtype == torch.bfloat16
    assert not torch.equal(a, dropout(x, 0.1))  # the generator moved on
    assert dropout(x, 0.1, training=False) is x and dropout(x, 0.0) is x
    assert torch.equal(dropout(x, 1.0), torch.zeros_like(x))
    module = Dropout(0.3).eval()
    assert module(x) is x


def test_activation_dropout_is_the_ffns_inner_dropout_only():
    base = dict(vocab_size=11, d_model=16, n_layers=1, n_heads=2, max_seq_len=8, activation="swiglu")
    x = torch.randn(3, 5, 16)
    ffn = FeedForward(ModelConfig(**base, dropout=0.5)).train()  # residual/embedding dropout: not inside the FFN
    torch.testing.assert_close(ffn(x), ffn.eval()(x))
    ffn = FeedForward(ModelConfig(**base, activation_dropout=0.5))
    torch.manual_seed(5)
    inner = ffn.act(ffn.gate_proj(x)) * ffn.up_proj(x)
    keep = keep_mask(inner.shape, 0.5)
    torch.manual_seed(5)
    torch.testing.assert_close(ffn.train()(x), ffn.down_proj(inner * keep * 2))
    with pytest.raises(Exception, match="activation_dropout must lie in"):
        ModelConfig(**base, activation_dropout=1.5)
