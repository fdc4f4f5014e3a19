"""Model shapes of the default preset (depth x width, grouped-query heads) and their parameter counts N."""
from __future__ import annotations

from dataclasses import dataclass

import torch

from lmkit.config import get_preset
from lmkit.errors import ConfigError
from lmkit.models import build_model

HEAD_DIM = 32  # the default preset's width per head; shapes keep it so that width and depth alone vary
PARAM_CONVENTIONS = ("non-embedding", "total")


@dataclass(frozen=True)
class Shape:
    """A model shape of the sweep: depth and width of the `default` preset, with grouped-query attention: the
    largest number of key/value heads that divides the heads and is at most half of them."""

    n_layers: int
    d_model: int

    @classmethod
    def parse(cls, text: str) -> "Shape":
        """'4x256' -> 4 layers of width 256."""
        try:
            layers, width = (int(v) for v in text.lower().split("x"))
        except ValueError:
            raise ConfigError(f"a shape is LAYERSxWIDTH such as 4x256, got {text!r}") from None
        if layers < 1 or width < HEAD_DIM or width % HEAD_DIM:
            raise ConfigError(f"shape {text!r}: need at least one layer and a width that is a multiple of {HEAD_DIM}")
        return cls(layers, width)

    @property
    def name(self) -> str:
        return f"{self.n_layers}x{self.d_model}"

    def overrides(self) -> dict:
        heads = self.d_model // HEAD_DIM
        kv_heads = max(k for k in range(1, max(1, heads // 2) + 1) if heads % k == 0)
        return dict(n_layers=self.n_layers, d_model=self.d_model, n_heads=heads, n_kv_heads=kv_heads)


DEFAULT_SHAPES = tuple(Shape.parse(s) for s in ("2x32", "1x64", "2x64", "3x64", "2x96", "2x128", "3x128"))


def count_parameters(model: torch.nn.Module, convention: str = "non-embedding") -> int:
    """Distinct parameters; "non-embedding" leaves out token and position embedding tables (Kaplan et al.'s N;
    a tied output head is the token table, so it goes too), "total" counts everything (Chinchilla's N)."""
    if convention not in PARAM_CONVENTIONS:
        raise ConfigError(f"parameter convention must be one of {', '.join(PARAM_CONVENTIONS)}, got {convention!r}")
    params = {id(p): p for p in model.parameters()}
    if convention == "non-embedding":
        for module in model.modules():
            if isinstance(module, torch.nn.Embedding):
                params.pop(id(module.weight), None)
    return sum(p.numel() for p in params.values())


def shape_parameters(shape: Shape, vocab_size: int, seq_len: int, convention: str = "non-embedding") -> int:
    config = get_preset("default", vocab_size=vocab_size, max_seq_len=seq_len, **shape.overrides())
    with torch.device("meta"):
        model = build_model(config)
    return count_parameters(model, convention)
