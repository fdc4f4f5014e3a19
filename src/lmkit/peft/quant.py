"""Block-wise weight quantization for QLoRA: linear weights stored in 8 or 4 bits, dequantized on the fly.

The weight is cut into blocks of `block_size` values; each block keeps one float scale s = max|w|.
int8: q = round(127 w / s), w ~ s q / 127.  NF4 (QLoRA's NormalFloat): q indexes the 16 levels
that split N(0, 1) into equal-probability bins (scaled to [-1, 1]), w ~ s * level[q]; two indices per byte.
"""
from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn

from lmkit.errors import ConfigError
from lmkit.peft.names import replace_module


def nf4_levels() -> torch.Tensor:
    """The 16 NF4 values: 8 positive and 7 negative normal quantiles and an exact 0, divided by the largest."""
    normal = torch.distributions.Normal(0.0, 1.0)
    offset = 0.9677083  # QLoRA's choice: the outermost quantiles (1 - offset in each tail) map to +-1
    pos = normal.icdf(torch.linspace(offset, 0.5, 9, dtype=torch.float64)[:-1].float())
    neg = -normal.icdf(torch.linspace(offset, 0.5, 8, dtype=torch.float64)[:-1].float())
    levels = torch.cat([pos, torch.zeros(1), neg]).sort().values
    return levels / levels.abs().max()


class QuantizedLinear(nn.Module):
    """y = x W~^T + b with W~ = dequantize(q, s); the stored weight is frozen (buffers only)."""

    def __init__(self, linear: nn.Linear, bits: int = 4, block_size: int = 64):
        super().__init__()
        if bits not in (4, 8):
            raise ConfigError(f"bits={bits} is not supported; use 8 (int8 blocks) or 4 (NF4 blocks)")
        if block_size <= 0 or block_size % 2:
            raise ConfigError(f"block_size must be a positive even number, got {block_size}")
        self.bits, self.block_size = bits, block_size
        self.in_features, self.out_features = linear.in_features, linear.out_features
        w = linear.weight.detach().float().reshape(-1)
        self.numel = w.numel()
        w = F.pad(w, (0, -self.numel % block_size)).view(-1, block_size)
        scale = w.abs().amax(dim=1).clamp(min=1e-12)
        if bits == 8:
            q = torch.round(w / scale[:, None] * 127).clamp(-127, 127).to(torch.int8)
        else:
            levels = nf4_levels()
            idx = (w / scale[:, None])[..., None].sub(levels).abs().argmin(-1).to(torch.uint8).view(-1)
            q = idx[0::2] | (idx[1::2] << 4)
            self.register_buffer("levels", levels, persistent=False)
        self.register_buffer("qweight", q)
        self.register_buffer("scales", scale)
        self.register_buffer("bias", None if linear.bias is None else linear.bias.detach().clone())
        self.compute_dtype = linear.weight.dtype

    @property
    def weight(self) -> torch.Tensor:
        return self.dequantize()

    def dequantize(self) -> torch.Tensor:
        """The (out, in) weight the quantized blocks stand for, in float32."""
        if self.bits == 8:
            w = self.qweight.float().view(-1, self.block_size) * (self.scales[:, None] / 127)
        else:
            idx = torch.stack([self.qweight & 0xF, self.qweight >> 4], dim=-1).view(-1).long()
            w = self.levels.to(self.scales.device)[idx].view(-1, self.block_size) * self.scales[:, None]
        return w.reshape(-1)[: self.numel].view(self.out_features, self.in_features)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        bias = None if self.bias is None else self.bias.to(x.dtype)
        return F.linear(x, self.dequantize().to(x.dtype), bias)

    def storage_bytes(self) -> int:
        return sum(b.numel() * b.element_size() for b in (self.qweight, self.scales))

    def extra_repr(self) -> str:
        kind = "int8" if self.bits == 8 else "nf4"
        return f"in={self.in_features}, out={self.out_features}, {kind}, block={self.block_size}"


def quantize_linears(model: nn.Module, bits: int = 4, block_size: int = 64,
                     skip: tuple[str, ...] = ("lm_head",)) -> list[str]:
    """Replace every nn.Linear (except names ending in `skip`) by a QuantizedLinear; the names replaced."""
    names = [n for n, m in model.named_modules() if isinstance(m, nn.Linear) and not n.endswith(skip)]
    tied = {id(p) for n, p in model.named_parameters() if any(n.startswith(s) for s in skip)}
    for name in names:
        linear = model.get_submodule(name)
        if id(linear.weight) in tied:
            continue
        replace_module(model, name, QuantizedLinear(linear, bits, block_size))
    return names
