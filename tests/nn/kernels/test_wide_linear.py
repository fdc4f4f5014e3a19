"""kernels.linear.linear: F.linear's value and gradients, its weight gradient formed transposed for wide layers."""
import pytest
import torch
import torch.nn.functional as F

from helpers.graphs import graph_nodes
from lmkit.nn.kernels.linear import linear
from tolerances import assert_close_in


@pytest.mark.parametrize("shape,out_features,bias", [((3, 37, 24), 61, True), ((50, 8), 9, False), ((2, 5, 16), 80, True)])
def test_a_wide_layer_gives_f_linears_value_and_gradients(shape, out_features, bias):
    torch.manual_seed(0)
    x = torch.randn(*shape, requires_grad=True)
    w = torch.randn(out_features, shape[-1], requires_grad=True)
    b = torch.randn(out_features, requires_grad=True) if bias else None
    y = linear(x, w, b)
    assert "_WideLinearBackward" in graph_nodes(y)
    grad = torch.randn_like(y)
    inputs = [x, w] + ([b] if bias else [])
    got = torch.autograd.grad(y, inputs, grad)
    x64, w64 = x.detach().double().requires_grad_(True), w.detach().double().requires_grad_(True)
    b64 = b.detach().double().requires_grad_(True) if bias else None
    want = F.linear(x64, w64, b64)
    want_grads = torch.autograd.grad(want, [x64, w64] + ([b64] if bias else []), grad.double())
    assert_close_in(torch.float32, y, want, steps=4 * shape[-1])
    rows = x.numel() // shape[-1]
    for g, exp in zip(got, want_grads):
        assert g.shape == exp.shape
        assert_close_in(torch.float32, g, exp, steps=4 * max(rows, out_features))


def test_only_what_needs_a_gradient_gets_one():
    x = torch.randn(4, 6)
    w = torch.randn(10, 6, requires_grad=True)
    (dw,) = torch.autograd.grad(linear(x, w).sum(), [w])
    torch.testing.assert_close(dw, torch.ones(4, 10).t() @ x)


def test_narrow_layers_no_gradients_and_low_precision_keep_f_linear():
    x = torch.randn(4, 16, requires_grad=True)
    for w in (torch.randn(8, 16, requires_grad=True), torch.randn(16, 16, requires_grad=True)):  # not wider out than in
        assert "_WideLinearBackward" not in graph_nodes(linear(x, w))
    wide = torch.randn(32, 16, requires_grad=True)
    with torch.no_grad():
        assert linear(x, wide).grad_fn is None
    assert "_WideLinearBackward" not in graph_nodes(linear(x.bfloat16(), wide.bfloat16()))
    with torch.autocast("cpu", dtype=torch.bfloat16):
        assert "_WideLinearBackward" not in graph_nodes(linear(x, wide))
    frozen = torch.randn(32, 16)
    assert "_WideLinearBackward" not in graph_nodes(linear(x, frozen))
