"""Dropout with a cheap mask on CPU: y = x * m / (1 - p'), m_i ~ Bernoulli(1 - p') independently.

ATen's CPU dropout draws one random double per element (bernoulli_), a sixth of a small model's training step
here. This mask compares 16-bit words, four cut from each 64-bit draw of torch's generator, with a threshold:
p' = round(p 2^16) / 2^16, so |p' - p| <= 2^-17; the scale 1/(1 - p') is rounded to x's dtype, as in torch's
CPU dropout. The draws come from torch's default generator, so `torch.manual_seed` fixes them. On other devices
(and where p' would round to 0 or 1) it is torch's own dropout.
"""
from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn

_WORDS = 1 << 16


def keep_mask(shape: torch.Size, p: float) -> torch.Tensor:
    """A bool tensor of `shape`, each entry True with probability 1 - round(p 2^16) / 2^16, independently."""
    n = shape.numel()
    draws = torch.empty(-(-n // 4), dtype=torch.int64, device="cpu").random_(-2**63, None)  # full 64-bit range: 4 fair words
    words = draws.view(torch.int16)[:n].view(shape)
    return words >= round(p * _WORDS) - _WORDS // 2


def dropout(x: torch.Tensor, p: float, training: bool = True) -> torch.Tensor:
    """Inverted dropout: zero each entry with probability p (p' on CPU, above) and scale the rest by 1/(1 - p)."""
    if not training or p == 0.0:
        return x
    dropped = round(p * _WORDS)
    if x.device.type != "cpu" or not 0 < dropped < _WORDS:
        return F.dropout(x, p, training=True)
    scale = _WORDS / (_WORDS - dropped)
    return x * keep_mask(x.shape, p).to(x.dtype).mul_(scale)


class Dropout(nn.Dropout):
    """`nn.Dropout` with the cheap CPU mask of `dropout`."""

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return dropout(x, self.p, self.training)
