"""lmkit: transformer language models end to end — tokenizers, building blocks, the three families,
training, decoding, fine-tuning, compression and evaluation.

The public API (see DESIGN.md) is imported lazily so that `import lmkit` stays cheap.
"""
from __future__ import annotations

import importlib

__version__ = "0.1.0"

_EXPORTS = {
    "load_model": ("lmkit.hub", "load_model"),
    "ModelConfig": ("lmkit.config", "ModelConfig"),
    "get_preset": ("lmkit.config", "get_preset"),
    "build_model": ("lmkit.models", "build_model"),
    "CausalLM": ("lmkit.models", "CausalLM"),
    "LmkitError": ("lmkit.errors", "LmkitError"),
    "load_tokenizer": ("lmkit.tokenizers", "load_tokenizer"),
    "train_tokenizer": ("lmkit.tokenizers", "train_tokenizer"),
    "SentenceEncoder": ("lmkit.sentence", "SentenceEncoder"),
}


# subpackages reachable as attributes (lmkit.tokenizers.load_tokenizer) without importing them first
_SUBMODULES = ("atomic", "compress", "config", "data", "errors", "evaluate", "finetune", "generation", "hub", "models",
               "nn", "objectives", "peft", "progress", "sentence", "tokenizers", "train")


def __getattr__(name: str):
    if name in _EXPORTS:
        module, attr = _EXPORTS[name]
        return getattr(importlib.import_module(module), attr)
    if name in _SUBMODULES:
        return importlib.import_module(f"lmkit.{name}")
    raise AttributeError(f"module 'lmkit' has no attribute {name!r}")


def __dir__():
    return sorted(list(globals()) + list(_EXPORTS) + list(_SUBMODULES))
