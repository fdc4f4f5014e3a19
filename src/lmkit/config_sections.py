"""Typed sections of `ModelConfig` for settings only some models carry: a task head (`TaskHead`), what
compression changed (`Compression`) and a sparse self-attention pattern (`SparseAttention`).

A setting holds `UNSET` until it is given, and only given settings are written: they serialize into the
`extra` object of lmkit's config under the keys (transformers' names) that config.json has always used, so
a folder reads back to the same config and writes the same bytes. A reader takes the default that fits
its model with `get(name, default)` (an Encoder's head is "mlm" when unset, an XLNet's "lm").
"""
from __future__ import annotations

import dataclasses
import math
from dataclasses import dataclass
from typing import Any

from lmkit.errors import ConfigError


class Unset:
    """The value of a setting that was not given (config.json lacks its key): readers apply their default."""

    _instance: "Unset | None" = None

    def __new__(cls) -> "Unset":
        if cls._instance is None:
            cls._instance = super().__new__(cls)
        return cls._instance

    def __repr__(self) -> str:
        return "UNSET"

    def __bool__(self) -> bool:
        return False

    def __copy__(self) -> "Unset":
        return self

    def __deepcopy__(self, memo) -> "Unset":
        return self

    def __reduce__(self) -> str:
        return "UNSET"


UNSET = Unset()


class _Section:
    """Given settings serialize as {name: value}; unset ones are left out."""

    def get(self, name: str, default: Any = None) -> Any:
        value = getattr(self, name)
        return default if value is UNSET else value

    def given(self) -> dict[str, Any]:
        return {f.name: getattr(self, f.name) for f in dataclasses.fields(self) if getattr(self, f.name) is not UNSET}

    @classmethod
    def keys(cls) -> tuple[str, ...]:
        return tuple(f.name for f in dataclasses.fields(cls))

    def __post_init__(self) -> None:
        check_types(self)


@dataclass(frozen=True)
class TaskHead(_Section):
    """The head of an encoder or XLNet model and the settings its loss and classifier read."""

    head: str | None | Unset = UNSET        # None: the bare model; unset: the class's default (Encoder "mlm", XLNet "lm")
    pooler: str | None | Unset = UNSET      # dense + "tanh", "relu" (or BigBird: its activation) on the pooled state, None: none;
                                            # unset: "tanh" for the heads that read the pooled output
    pooling: str | Unset = UNSET            # the pooled state: "cls" (first position, the unset default) or "mean"
    num_labels: int | Unset = UNSET         # outputs of a classification head; unset: 2
    problem_type: str | None | Unset = UNSET  # the sequence head's loss; None or unset: inferred as transformers does
    classifier_dropout: float | None | Unset = UNSET  # before the classifier; None or unset: the hidden dropout
    mlm_activation: str | Unset = UNSET     # the masked-LM head's transform activation; unset: the model's activation
    summary: dict | Unset = UNSET           # XLNet's sequence summary (transformers' summary_* settings)


@dataclass(frozen=True)
class Compression(_Section):
    """What head pruning and int8 quantization changed, which loading must rebuild before the weights fit."""

    attention_heads: dict | Unset = UNSET   # {attention module: [query heads, key/value heads]} left after pruning
    pruned_heads: dict | Unset = UNSET      # {attention module: the original indices of the heads pruned}
    quantization: dict | Unset = UNSET      # {"method": ..., "modules": the linear layers stored as int8}


def check_types(obj) -> None:
    """Each field of a config dataclass holds the type its annotation names: config.json can put a string, a
    float or a list where an integer belongs, and the builders would fail far from the cause."""
    for f in dataclasses.fields(obj):
        value, kinds = getattr(obj, f.name), str(f.type).replace(" ", "").split("|")
        if isinstance(value, _Section):
            continue  # a section checks its own fields
        number = isinstance(value, (int, float)) and not isinstance(value, bool)
        ok = (value is None and "None" in kinds
              or value is UNSET and "Unset" in kinds
              or "int" in kinds and number and isinstance(value, int)
              or "float" in kinds and number and math.isfinite(value)
              or "bool" in kinds and isinstance(value, bool)
              or "str" in kinds and isinstance(value, str)
              or any(k.startswith("dict") for k in kinds) and isinstance(value, dict)
              or "list[int]" in kinds and isinstance(value, list)
              and all(isinstance(v, int) and not isinstance(v, bool) for v in value)
              # token ids: transformers allows a list (several end-of-sequence tokens)
              or f.name.endswith("token_id") and isinstance(value, list) and value
              and all(isinstance(v, int) and not isinstance(v, bool) for v in value))
        if not ok:
            shown = [k for k in kinds if k != "Unset"]
            raise ConfigError(f"{f.name}={value!r} is not of type {' | '.join(shown)}; fix that field")


SPARSE_KINDS = ("longformer", "bigbird")
BIGBIRD_TYPES = ("block_sparse", "original_full")


@dataclass(frozen=True)
class SparseAttention(_Section):
    """An encoder's sparse self-attention pattern (`lmkit.nn.sparse_attention`), under transformers' key names.

    Longformer: each layer's queries see the keys within attention_window / 2 positions plus the global tokens.
    BigBird: blocks of block_size tokens see their neighbour blocks, the global first and last blocks and
    num_random_blocks random ones (attention_type "block_sparse"), or every token ("original_full")."""

    sparse_attention: str | Unset = UNSET      # "longformer" or "bigbird"; unset: dense attention
    attention_window: list[int] | Unset = UNSET  # Longformer: the two-sided window of each layer (even, > 0)
    attention_type: str | Unset = UNSET        # BigBird: "block_sparse" (unset default) or "original_full"
    block_size: int | Unset = UNSET            # BigBird: tokens per block; unset: 64
    num_random_blocks: int | Unset = UNSET     # BigBird: random key blocks per query block; unset: 3
    random_seed: int | Unset = UNSET           # BigBird: seed of the random blocks (layer i draws from seed + i)

    def __post_init__(self) -> None:
        super().__post_init__()
        kind = self.get("sparse_attention")
        if kind is not None and kind not in SPARSE_KINDS:
            raise ConfigError(f"sparse_attention={kind!r} is not supported; choose one of {', '.join(SPARSE_KINDS)}")
        window = self.get("attention_window")
        if window is not None and not all(w > 0 and w % 2 == 0 for w in window):
            raise ConfigError(f"attention_window must hold one even, positive window per layer, got {window!r}")
        kind_of = self.get("attention_type")
        if kind_of is not None and kind_of not in BIGBIRD_TYPES:
            raise ConfigError(f"attention_type={kind_of!r} is not supported; choose one of {', '.join(BIGBIRD_TYPES)}")
        for name in ("block_size", "num_random_blocks"):
            value = self.get(name)
            if value is not None and (value < 1 if name == "block_size" else value < 0):
                raise ConfigError(f"{name} must be {'positive' if name == 'block_size' else '0 or more'}, got {value!r}")
