"""Load and save hooks of the layers above the hub (compression) whose models a folder may hold.

A model that pruning or quantization changed records it in its config (`config.compression`, under `key`); the
layer that made the change registers a `FolderHook` for that key, and the hub runs it when it reads
or writes such a model, without importing that layer.
"""
from __future__ import annotations

import importlib
from dataclasses import dataclass
from typing import Any, Callable

import torch

from lmkit.config import ModelConfig


@dataclass(frozen=True)
class FolderHook:
    """What loading and saving a model marked by config.compression.<key> needs beyond the weight-name tables."""

    key: str
    # (checkpoint tensors, config, the dtype asked for, folder) -> (tensors a float model loads, what `restore` needs)
    read: Callable[[dict, ModelConfig, torch.dtype | None, Any], tuple[dict, Any]] | None = None
    build: Callable[[torch.nn.Module], Any] | None = None  # reshapes a freshly built model before its weights load
    restore: Callable[[torch.nn.Module, Any], torch.nn.Module] | None = None  # (loaded model, read's) -> model
    tensors: Callable[[torch.nn.Module], dict] | None = None  # tensors to save that the state dict lacks


_HOOKS: dict[str, FolderHook] = {}
# config.compression setting -> the module that registers its hook when imported: a folder can hold such a model before
# anything in the process imported that module (`lmkit generate --model pruned/`)
PROVIDERS = {"attention_heads": "lmkit.compress.prune", "quantization": "lmkit.compress.quantize"}


def register_folder_hook(hook: FolderHook) -> None:
    _HOOKS[hook.key] = hook


def folder_hooks(config: ModelConfig) -> list[FolderHook]:
    """The hooks of the settings config.compression gives, in the order of PROVIDERS."""
    out = []
    for key, provider in PROVIDERS.items():
        if config.compression.get(key):
            if key not in _HOOKS:
                importlib.import_module(provider)
            out.append(_HOOKS[key])
    return out
