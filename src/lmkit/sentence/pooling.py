"""What sentence-transformers runs after the encoder: pooling of the token states, Dense layers, quantization.

Pooling modes: cls, max, mean, mean_sqrt_len_tokens, weightedmean, lasttoken (concatenated in the order
given); Dense y = act(W x + b) with any torch.nn activation; precision int8/uint8/binary/ubinary.
"""
from __future__ import annotations

import importlib
from dataclasses import dataclass

import numpy as np
import torch

from lmkit.errors import ConfigError


def pool_tokens(h: torch.Tensor, mask: torch.Tensor, modes: tuple[str, ...],
                start: torch.Tensor | None = None) -> torch.Tensor:
    """The pooled vectors of each mode, concatenated: (B, T, d), mask (B, T) -> (B, d * len(modes)).

    The mask keeps the tokens pooled: not padding, not a prompt left out (include_prompt false); `start` (B,) is
    each row's first real position (its left padding; default 0). cls: the first kept token; max: max_t over kept
    t; mean: sum_t m_t h_t / sum_t m_t; mean_sqrt_len_tokens: the same sum over sqrt(sum_t m_t); weightedmean:
    weights t + 1 - start; lasttoken: the last kept token (zeros if none).
    """
    m = mask.unsqueeze(-1).to(h.dtype)
    rows, kept = torch.arange(h.shape[0], device=h.device), mask.to(torch.int)
    parts = []
    for mode in modes:
        if mode == "cls":
            parts.append(h[rows, kept.argmax(dim=1)])
        elif mode == "max":
            parts.append(h.masked_fill(m == 0, float("-inf")).max(dim=1).values)
        elif mode in ("mean", "mean_sqrt_len_tokens"):
            total, count = (h * m).sum(dim=1), m.sum(dim=1).clamp(min=1e-9)
            parts.append(total / count if mode == "mean" else total / count.sqrt())
        elif mode == "weightedmean":
            w = torch.arange(1, h.shape[1] + 1, device=h.device, dtype=h.dtype).view(1, -1, 1)
            w = m * (w - start.view(-1, 1, 1).to(h.dtype) if start is not None else w)
            parts.append((h * w).sum(dim=1) / w.sum(dim=1).clamp(min=1e-9))
        else:  # lasttoken
            last = h.shape[1] - 1 - kept.flip(1).argmax(dim=1)
            parts.append((h * m)[rows, last])
    return torch.cat(parts, dim=-1)


QUANTIZE = ("float32", "int8", "uint8", "binary", "ubinary")


def quantize(emb: np.ndarray, precision: str) -> np.ndarray:
    """sentence-transformers' `precision`: int8/uint8 cut each dimension's [min, max] over these rows into 255 steps,
    q = clip(floor((e - min) / step), 0, 255) (minus 128 for int8); binary/ubinary pack the bits e > 0 (minus 128)."""
    if precision.endswith("int8"):
        if len(emb) < 2:
            raise ConfigError(f"precision {precision!r} takes its ranges from the embeddings, so it needs at least two; "
                              "encode more texts at once or quantize with ranges of your own")
        low, high = emb.min(axis=0), emb.max(axis=0)
        step = (high - low) / 255
        q = np.clip(np.floor((emb - low) / np.where(step == 0, 1, step)), 0, 255)
        return q.astype(np.uint8) if precision == "uint8" else (q - 128).astype(np.int8)
    bits = np.packbits(emb > 0, axis=-1)
    return bits if precision == "ubinary" else (bits - 128).astype(np.int8)


@dataclass
class Dense:
    """y = act(W x + b), plus x (or R x when the sizes differ) with use_residual."""
    weight: torch.Tensor
    bias: torch.Tensor | None
    act: torch.nn.Module
    residual: torch.Tensor | bool = False

    def __call__(self, x: torch.Tensor) -> torch.Tensor:
        y = x @ self.weight.t().to(x)
        y = self.act(y + self.bias.to(x) if self.bias is not None else y)
        if isinstance(self.residual, torch.Tensor):
            return y + x @ self.residual.t().to(x)
        return y + x if self.residual else y


def dense_activation(name: str) -> torch.nn.Module:
    """The activation a Dense config names, as sentence-transformers builds it: a torch.nn.Module class
    (torch.nn.modules.activation.Tanh, ...) called without arguments. Other code is never imported."""
    module, _, cls = name.rpartition(".")
    if not module.startswith("torch."):
        raise ConfigError(f"Dense activation {name!r} is not a torch.nn activation; lmkit runs torch.nn classes only "
                          "(sentence-transformers needs trust_remote_code for others)")
    try:
        act = getattr(importlib.import_module(module), cls)
        if not (isinstance(act, type) and issubclass(act, torch.nn.Module)):
            raise TypeError("not a torch.nn.Module class")
        return act()
    except (ImportError, AttributeError, TypeError) as exc:
        raise ConfigError(f"Dense activation {name!r} cannot be built ({exc}); name a torch.nn activation class "
                          "such as torch.nn.modules.activation.Tanh") from None
