"""Tolerances of half-precision results, derived from the format and the size of what is compared.

A result computed in a format with relative step eps (torch.finfo: 2**-7 for bf16, 2**-10 for fp16, 2**-23 for
fp32) carries about eps/2 relative error per rounding, and a network's output a few such errors at the scale of its
largest values. So a check allows `steps` relative steps of the format times the largest magnitude expected: a
bound that follows the format and the data, not a number one CPU's kernels happen to meet (native bf16 kernels
and emulated ones round in different places). Each test names its `steps`: about the rounding depth of what it
compares, with room for the worst case seen under both kinds of kernels (docs/portability.md).
"""
from __future__ import annotations

import torch


def resolution(dtype: torch.dtype) -> float:
    """The relative step of `dtype` at 1: 2**-7 (bf16), 2**-10 (fp16), 2**-23 (fp32)."""
    return torch.finfo(dtype).eps


def tolerance(dtype: torch.dtype, expected: torch.Tensor, steps: float) -> float:
    """steps x resolution(dtype) x max|expected|: an absolute bound on elementwise differences."""
    return steps * resolution(dtype) * expected.detach().abs().max().item()


def assert_close_in(dtype: torch.dtype, actual: torch.Tensor, expected: torch.Tensor, steps: float) -> None:
    """max|actual - expected| <= tolerance(dtype, expected, steps), both compared in float64."""
    actual, expected = actual.detach().double(), expected.detach().double()
    assert actual.shape == expected.shape, f"shapes {tuple(actual.shape)} and {tuple(expected.shape)}"
    bound = tolerance(dtype, expected, steps)
    worst = (actual - expected).abs().max().item()
    assert worst <= bound, (f"max |difference| {worst:.4g} > {steps} x {resolution(dtype):.3g} ({dtype}) x max|expected| "
                            f"{expected.abs().max().item():.4g} = {bound:.4g}: {worst / (bound / steps):.2f} steps")


def assert_close_in_norm(dtype: torch.dtype, actual: torch.Tensor, expected: torch.Tensor, steps: float) -> None:
    """||actual - expected|| / ||expected|| <= steps x resolution(dtype) (Frobenius norms, in float64)."""
    actual, expected = actual.detach().double(), expected.detach().double()
    ratio = ((actual - expected).norm() / expected.norm()).item()
    assert ratio <= steps * resolution(dtype), (f"relative error {ratio:.4g} > {steps} x {resolution(dtype):.3g} "
                                                f"({dtype}): {ratio / resolution(dtype):.2f} steps")
