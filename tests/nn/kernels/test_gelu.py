"""The compiled GELU (tanh form): its math in float64, agreement with ATen in bf16, and its fallbacks."""
import pytest
import torch
import torch.nn.functional as F

from helpers.graphs import graph_nodes
from lmkit.nn.kernels import gelu as kernels
from lmkit.nn.kernels.gelu import gelu_tanh
from tolerances import assert_close_in, assert_close_in_norm


def test_sigmoid_form_is_the_tanh_gelu_and_its_derivative():
    x = torch.linspace(-12, 12, 2001, dtype=torch.float64, requires_grad=True)
    want = F.gelu(x, approximate="tanh")
    (want_grad,) = torch.autograd.grad(want.sum(), x)
    torch.testing.assert_close(kernels._forward(x.detach()), want.detach(), atol=1e-13, rtol=1e-12)
    torch.testing.assert_close(kernels._backward(torch.ones_like(x), x.detach()), want_grad, atol=1e-12, rtol=1e-12)
    grad = torch.randn_like(x)
    torch.testing.assert_close(kernels._backward(grad, x.detach()), grad * want_grad, atol=1e-12, rtol=1e-12)


def _compiled_or_skip():
    if not kernels.compiled_kernels():
        pytest.skip("no working inductor/C++ compiler here: gelu_tanh is ATen's GELU")


@pytest.mark.bf16
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16])
def test_compiled_gelu_agrees_with_aten_in_low_precision(dtype):
    """One rounding of the float32 result: ATen's numbers for |x| < 2.5 but for the last bit of rare elements;
    in the negative tail, where ATen's 0.5 x (1 + tanh) cancels, at least as close to the float64 truth."""
    _compiled_or_skip()
    torch.manual_seed(0)
    x = (torch.randn(3, 77, 211) * 3).to(dtype).requires_grad_()
    y = gelu_tanh(x)
    assert y.grad_fn is not None and "GeluTanh" in type(y.grad_fn).__name__
    ref_x = x.detach().clone().requires_grad_()
    ref = F.gelu(ref_x, approximate="tanh")
    grad = torch.randn_like(y)
    (got,) = torch.autograd.grad(y, x, grad)
    (want,) = torch.autograd.grad(ref, ref_x, grad)
    core = x.detach().abs() < 2.5
    assert (y != ref)[core].float().mean() < 1e-3
    assert (got != want)[core].float().mean() < 1e-3
    exact_x = x.detach().double().requires_grad_()
    exact = F.gelu(exact_x, approximate="tanh")
    (exact_grad,) = torch.autograd.grad(exact, exact_x, grad.double())
    for ours, aten, truth in ((y, ref, exact), (got, want, exact_grad)):
        ours_err, aten_err = (ours.double() - truth).abs(), (aten.double() - truth).abs()
        assert ours_err.mean() <= aten_err.mean()
        assert ours_err.max() <= aten_err.max()
    with torch.no_grad():
        torch.testing.assert_close(gelu_tanh(x), y.detach(), rtol=0, atol=0)


@pytest.mark.bf16
def test_gelu_training_step_of_a_gpt2_block_under_autocast(monkeypatch):
    """A bf16 GPT-2 feed-forward trains through the compiled GELU (and, switched off, through ATen's):
    the gradients of the two agree to bf16 precision."""
    _compiled_or_skip()
    from lmkit.config import ModelConfig
    from lmkit.nn import FeedForward

    calls = []
    apply = kernels._GeluTanh.apply
    monkeypatch.setattr(kernels._GeluTanh, "apply", lambda x: calls.append(x.dtype) or apply(x))
    torch.manual_seed(0)
    ffn = FeedForward(ModelConfig(d_model=64, n_heads=4, n_layers=1, vocab_size=32, activation="gelu_tanh"))
    x = torch.randn(4, 70, 64)
    grads = []
    for enabled in ("1", "0"):
        monkeypatch.setattr(kernels, "_compiled", None)
        monkeypatch.setenv("LMKIT_COMPILE_KERNELS", enabled)
        ffn.zero_grad()
        with torch.autocast("cpu", dtype=torch.bfloat16):
            ffn(x).float().square().mean().backward()
        grads.append([p.grad.clone() for p in ffn.parameters()])
        assert calls == [torch.bfloat16]  # the compiled kernel ran in the first pass only
    for a, b in zip(*grads):
        assert_close_in(torch.bfloat16, a, b, steps=2)


@pytest.mark.bf16
def test_falls_back_to_aten_exactly(monkeypatch):
    x = torch.randn(64, 300).bfloat16()
    ref = F.gelu(x, approximate="tanh")
    assert torch.equal(gelu_tanh(x.t()), F.gelu(x.t(), approximate="tanh"))  # not contiguous
    assert torch.equal(gelu_tanh(x[:2]), ref[:2])  # too small to gain
    assert torch.equal(gelu_tanh(x.double()), F.gelu(x.double(), approximate="tanh"))  # float64: ATen's
    monkeypatch.setenv("LMKIT_COMPILE_KERNELS", "0")
    monkeypatch.setattr(kernels, "_compiled", None)
    assert kernels.compiled_kernels() == ()
    assert kernels.kernels_for(torch.float32) == ()
    assert torch.equal(gelu_tanh(x), ref)
    assert torch.equal(gelu_tanh(x.float()), F.gelu(x.float(), approximate="tanh"))


def test_compiled_gelu_in_float32_is_within_float32_steps_of_the_exact_value():
    """float32 through the compiled kernel (where it passed its float32 check): values and gradients within a few
    float32 steps of the float64 formula, on average within twice ATen's error (the backward's s (1 - s) rounds
    where sigmoid nears 1), and the same with gradients off."""
    if not kernels.kernels_for(torch.float32):
        pytest.skip("no working inductor/C++ compiler for float32 here: gelu_tanh is ATen's GELU")
    torch.manual_seed(0)
    x = (torch.randn(3, 77, 211) * 3).requires_grad_()
    y = gelu_tanh(x)
    assert "GeluTanh" in type(y.grad_fn).__name__
    grad = torch.randn_like(y)
    (got,) = torch.autograd.grad(y, x, grad)
    ref_x = x.detach().clone().requires_grad_()
    ref = F.gelu(ref_x, approximate="tanh")
    (want,) = torch.autograd.grad(ref, ref_x, grad)
    exact_x = x.detach().double().requires_grad_()
    exact = F.gelu(exact_x, approximate="tanh")
    (exact_grad,) = torch.autograd.grad(exact, exact_x, grad.double())
    for ours, aten, truth in ((y, ref, exact), (got, want, exact_grad)):
        assert_close_in(torch.float32, ours, truth, steps=16)
        assert_close_in_norm(torch.float32, ours, truth, steps=4)
        assert (ours.double() - truth).abs().mean() <= 2 * (aten.double() - truth).abs().mean()
    with torch.no_grad():
        torch.testing.assert_close(gelu_tanh(x), y.detach(), rtol=0, atol=0)


def test_a_dtype_whose_compiled_kernel_fails_its_check_keeps_aten(monkeypatch):
    """Each dtype is checked on first use: a kernel wrong only in float32 leaves float32 on ATen's GELU."""
    def broken_in_float32(fn, **_):
        def run(*args):
            out = fn(*args)
            return out.masked_fill(args[-1] > 5.9, float("nan")) if out.dtype == torch.float32 else out
        return run

    monkeypatch.setenv("LMKIT_COMPILE_KERNELS", "1")
    monkeypatch.setattr(kernels, "_compiled", None)
    monkeypatch.setattr(torch, "compile", broken_in_float32)
    assert len(kernels.compiled_kernels()) == 2
    assert kernels.kernels_for(torch.float32) == ()
    assert len(kernels.kernels_for(torch.bfloat16)) == 2
    x = torch.randn(64, 300)
    assert torch.equal(gelu_tanh(x), F.gelu(x, approximate="tanh"))
    monkeypatch.setattr(kernels, "_compiled", None)  # a fresh compile checks every dtype again


@pytest.mark.bf16
def test_a_compiled_kernel_with_wrong_numbers_is_not_used(monkeypatch):
    """The first compile is checked against the float64 formula: a kernel that returns NaN for some inputs (as
    inductor's AVX2 code does under ATEN_CPU_CAPABILITY=avx2 on an AVX-512 CPU) leaves ATen's GELU in place."""
    def broken(fn, **_):
        def run(*args):
            out = fn(*args)
            return out.masked_fill(args[-1] > 5.9, float("nan"))
        return run

    monkeypatch.setenv("LMKIT_COMPILE_KERNELS", "1")
    monkeypatch.setattr(kernels, "_compiled", None)
    monkeypatch.setattr(torch, "compile", broken)
    assert kernels.compiled_kernels() == ()
    x = torch.randn(64, 300).bfloat16()
    assert torch.equal(gelu_tanh(x), F.gelu(x, approximate="tanh"))
    monkeypatch.setattr(kernels, "_compiled", None)
    monkeypatch.setattr(torch, "compile", lambda fn, **_: fn)  # the formula itself passes the check
    assert len(kernels.compiled_kernels()) == 2



@pytest.mark.parametrize("shape", [(3, 101, 40), (7000, 13)])  # rows of no vector multiple; many short rows
def test_gelu_of_a_linear_layer_with_its_bias_in_the_kernel_matches_float64(shape):
    """gelu_tanh(x W^T + b) with b added inside the compiled GELU: value and the gradients of x, W and b."""
    if not kernels.bias_kernels():
        pytest.skip("no working inductor/C++ compiler here")
    torch.manual_seed(0)
    linear = torch.nn.Linear(shape[-1], 300 if shape[-1] > 20 else 17)
    x = torch.randn(*shape, requires_grad=True)
    y = kernels.gelu_tanh_linear(x, linear)
    assert "_GeluTanhBiasBackward" in graph_nodes(y)
    grad = torch.randn_like(y)
    got = torch.autograd.grad(y, [x, linear.weight, linear.bias], grad)
    x64 = x.detach().double().requires_grad_(True)
    w64, b64 = (p.detach().double().requires_grad_(True) for p in (linear.weight, linear.bias))
    want = F.gelu(F.linear(x64, w64, b64), approximate="tanh")
    want_grads = torch.autograd.grad(want, [x64, w64, b64], grad.double())
    assert_close_in(torch.float32, y, want, steps=16)
    for g, w in zip(got, want_grads):
        assert_close_in(torch.float32, g, w, steps=64 * shape[-2])  # sums over the rows


def test_gelu_of_a_linear_layer_keeps_the_plain_path_where_the_kernel_does_not_apply():
    torch.manual_seed(0)
    linear = torch.nn.Linear(40, 300)
    x = torch.randn(4, 50, 40, requires_grad=True)
    with torch.no_grad():
        assert torch.equal(kernels.gelu_tanh_linear(x, linear), gelu_tanh(linear(x)))
    with torch.autocast("cpu", dtype=torch.bfloat16):
        assert "_GeluTanhBiasBackward" not in graph_nodes(kernels.gelu_tanh_linear(x, linear))
    hooked = torch.nn.Linear(40, 300)
    hooked.register_forward_hook(lambda m, i, o: o * 2)
    assert torch.equal(kernels.gelu_tanh_linear(x, hooked), gelu_tanh(hooked(x)))  # the hook runs
    no_bias = torch.nn.Linear(40, 300, bias=False)
    assert "_GeluTanhBiasBackward" not in graph_nodes(kernels.gelu_tanh_linear(x, no_bias))


def test_a_gelu_with_bias_kernel_with_wrong_numbers_is_not_used(monkeypatch):
    real = kernels._forward_bias
    monkeypatch.setattr(kernels, "_bias_compiled", None)
    monkeypatch.setattr(kernels, "_forward_bias", lambda x, b: real(x, b) * 1.01)
    monkeypatch.setattr(torch, "compile", lambda fn, **_: fn)
    monkeypatch.setattr(kernels, "_compiled", None)
    assert kernels.bias_kernels() == ()
    linear = torch.nn.Linear(40, 300)
    x = torch.randn(4, 50, 40, requires_grad=True)
    assert "_GeluTanhBiasBackward" not in graph_nodes(kernels.gelu_tanh_linear(x, linear))
    monkeypatch.setattr(kernels, "_bias_compiled", None)
    monkeypatch.setattr(kernels, "_compiled", None)
