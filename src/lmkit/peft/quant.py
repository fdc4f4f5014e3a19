"""Block-wise weight quantization for QLoRA: linear weights stored in 8 or 4 bits, dequantized on the fly.

The weight is cut into blocks of `block_size` values; each block keeps one float scale s = max|w|.
int8: q = round(127 w / s), w ~ s q / 127.  NF4 (QLoRA's NormalFloat): q indexes the 16 levels
that split N(0, 1) into equal-probability bins (scaled to [-1, 1]), w ~ s * level[q]; two indices per byte, as
bitsandbytes packs them. Double quantization (QLoRA's DQ) stores the scales themselves in 8 bits (`double_quantize`).
"""
from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn

from lmkit.errors import ConfigError
from lmkit.peft.names import replace_module


def nf4_levels() -> torch.Tensor:
    """The 16 NF4 values: 8 positive and 7 negative normal quantiles and an exact 0, divided by the largest.

    Computed as QLoRA's `create_normal_map` does (float32 probabilities, float64 quantiles, float32 division), so
    the table equals the paper's and bitsandbytes' to the last bit."""
    normal = torch.distributions.Normal(torch.tensor(0.0, dtype=torch.float64), torch.tensor(1.0, dtype=torch.float64))
    offset = 0.9677083  # QLoRA's choice: the outermost quantiles (1 - offset in each tail) map to +-1
    pos = normal.icdf(torch.linspace(offset, 0.5, 9)[:-1].double())
    neg = -normal.icdf(torch.linspace(offset, 0.5, 8)[:-1].double())
    levels = torch.cat([pos, torch.zeros(1, dtype=torch.float64), neg]).float().sort().values
    return levels / levels.max()


class QuantizedLinear(nn.Module):
    """y = x W~^T + b with W~ = dequantize(q, s); the stored weight is frozen (buffers only)."""

    def __init__(self, linear: nn.Linear, bits: int = 4, block_size: int = 64, double_quant: bool = False):
        super().__init__()
        if double_quant and bits != 4:
            raise ConfigError("double quantization applies to NF4 (bits=4); drop it or use 4 bits")
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
            q = (idx[0::2] << 4) | idx[1::2]  # bitsandbytes' layout: the earlier value in the high nibble
            self.register_buffer("levels", levels, persistent=False)
        self.register_buffer("qweight", q)
        self.double_quant = double_quant
        if double_quant:  # the scales kept only as 8-bit codes, their blocks' absmax and their mean
            qscales, scale_absmax, offset = double_quantize(scale)
            self.register_buffer("qscales", qscales)
            self.register_buffer("scale_absmax", scale_absmax)
            self.register_buffer("scale_offset", torch.tensor(offset))
            self.register_buffer("scales", None)
        else:
            self.register_buffer("scales", scale)
        self.register_buffer("bias", None if linear.bias is None else linear.bias.detach().clone())
        self.compute_dtype = linear.weight.dtype

    @property
    def weight(self) -> torch.Tensor:
        return self.dequantize()

    def block_scales(self) -> torch.Tensor:
        """The float32 absmax of each block (restored from its 8-bit code under double quantization)."""
        if not self.double_quant:
            return self.scales
        return double_dequantize(self.qscales, self.scale_absmax, self.scale_offset.item())

    def dequantize(self) -> torch.Tensor:
        """The (out, in) weight the quantized blocks stand for, in float32."""
        scales = self.block_scales()
        if self.bits == 8:
            w = self.qweight.float().view(-1, self.block_size) * (scales[:, None] / 127)
        else:
            idx = torch.stack([self.qweight >> 4, self.qweight & 0xF], dim=-1).view(-1).long()
            w = self.levels.to(scales.device)[idx].view(-1, self.block_size) * scales[:, None]
        return w.reshape(-1)[: self.numel].view(self.out_features, self.in_features)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        bias = None if self.bias is None else self.bias.to(x.dtype)
        return F.linear(x, self.dequantize().to(x.dtype), bias)

    def storage_bytes(self) -> int:
        kept = (self.qweight, self.qscales, self.scale_absmax, self.scale_offset) if self.double_quant \
            else (self.qweight, self.scales)
        return sum(b.numel() * b.element_size() for b in kept)

    def extra_repr(self) -> str:
        kind = "int8" if self.bits == 8 else "nf4" + (" + double quant" if self.double_quant else "")
        return f"in={self.in_features}, out={self.out_features}, {kind}, block={self.block_size}"


def quantize_linears(model: nn.Module, bits: int = 4, block_size: int = 64,
                     skip: tuple[str, ...] = ("lm_head",), double_quant: bool = False) -> list[str]:
    """Replace every nn.Linear (except names ending in `skip`) by a QuantizedLinear; the names replaced."""
    names = [n for n, m in model.named_modules() if isinstance(m, nn.Linear) and not n.endswith(skip)]
    tied = {id(p) for n, p in model.named_parameters() if any(n.startswith(s) for s in skip)}
    for name in names:
        linear = model.get_submodule(name)
        if id(linear.weight) in tied:
            continue
        replace_module(model, name, QuantizedLinear(linear, bits, block_size, double_quant))
    return names


def dynamic_map(exponent_bits: int = 7, total_bits: int = 8) -> torch.Tensor:
    """Dettmers' signed dynamic 8-bit data type (a decimal exponent of 10^-6..10^0 and a shrinking fraction), the
    256 sorted values bitsandbytes' `create_dynamic_map(signed=True)` makes: the code double quantization uses."""
    data: list[float] = []
    fraction_bits = total_bits - 1 - exponent_bits
    for i in range(exponent_bits):
        bounds = torch.linspace(0.1, 1, 2 ** (i + fraction_bits) + 1, dtype=torch.float32)
        means = (bounds[:-1] + bounds[1:]) / 2.0
        scale = 10 ** (-(exponent_bits - 1) + i)
        data += (scale * means).tolist() + (-scale * means).tolist()  # float32 products, as bitsandbytes rounds them
    extra = 2 ** fraction_bits - 1
    if extra > 0:
        bounds = torch.linspace(0.1, 1, extra + 1, dtype=torch.float32)
        means = (bounds[:-1] + bounds[1:]) / 2.0
        data += (scale * means).tolist() + (-scale * means).tolist()
    data += [0.0, 1.0]
    data += [0.0] * (2 ** total_bits - len(data))  # bitsandbytes pads a short code with zeros
    return torch.tensor(data, dtype=torch.float32).sort().values


def blockwise_quantize(x: torch.Tensor, code: torch.Tensor, block_size: int) -> tuple[torch.Tensor, torch.Tensor]:
    """Each block of `x` divided by its absmax, then the index of the nearest value of the sorted `code` (ties to
    the lower one, as bitsandbytes' reference kernel's bucketize over midpoints): (uint8 indices, float32 absmax
    per block)."""
    flat = x.float().reshape(-1)
    blocks = F.pad(flat, (0, -flat.numel() % block_size)).view(-1, block_size)
    absmax = blocks.abs().amax(dim=1)
    normed = blocks * (1.0 / absmax.clamp(min=1e-30))[:, None]  # times the reciprocal, as bitsandbytes rounds it
    idx = torch.bucketize(normed.clamp(-1, 1), (code[:-1] + code[1:]) / 2)
    return idx.to(torch.uint8).view(-1)[: flat.numel()], absmax


def double_quantize(scales: torch.Tensor, block_size: int = 256) -> tuple[torch.Tensor, torch.Tensor, float]:
    """QLoRA's double quantization of the first-level scales c2: centre them on their mean, then 8-bit blockwise
    with the dynamic code and blocks of 256 (c1 per block). Returns (uint8 codes, c1 float32, the mean)."""
    offset = scales.float().mean()
    q, absmax = blockwise_quantize(scales.float() - offset, dynamic_map(), block_size)
    return q, absmax, float(offset)


def double_dequantize(q: torch.Tensor, absmax: torch.Tensor, offset: float, block_size: int = 256) -> torch.Tensor:
    """The scales back: code[q] * c1 of each block + the mean."""
    values = dynamic_map()[q.long()]
    values = F.pad(values, (0, -values.numel() % block_size)).view(-1, block_size) * absmax[:, None]
    return values.reshape(-1)[: q.numel()] + offset
