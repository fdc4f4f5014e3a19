"""What a Hugging Face format family gives the hub: one `Family` per module of lmkit/hub/.

The hub reads a folder by asking the family of config.json's `model_type` for a `ModelConfig`
(`config_from_hf`) and the weight-name `Rule` table of that config (`rules`), builds the model and
renames the tensors; saving runs the same table the other way. Everything else a format needs is an
optional hook or a capability flag declared here, so that the hub never probes a module for names.
"""
from __future__ import annotations

from dataclasses import dataclass
from typing import Callable, Iterable

import torch

from lmkit.config import ModelConfig
from lmkit.hub.convert import Rule


@dataclass(frozen=True)
class Family:
    """A Hugging Face format: its config mapping both ways, its weight-name table, hooks and capabilities."""

    model_types: tuple[str, ...]                   # config.json `model_type` values this family reads
    hf_classes: tuple[str, ...]                    # transformers classes its folders load into (first: the default)
    config_from_hf: Callable[[dict], ModelConfig]  # config.json -> ModelConfig; ConfigError for what it cannot hold
    config_to_hf: Callable[[ModelConfig], dict]    # ModelConfig -> config.json; ConfigError for a model it cannot hold
    rules: Callable[[ModelConfig], list[Rule]]     # lmkit tensor names <-> Hugging Face tensor names
    # (prefix, replacement): other spellings a checkpoint may use (a base model saved without its head's prefix)
    aliases: tuple[tuple[str, str], ...] = ()
    # hooks
    build: Callable[[ModelConfig, dict, Iterable[str]], torch.nn.Module] | None = None  # (config, config.json,
    # tensor names) -> model, where config.json's class picks the head; default: models.build_model(config)
    prepare_weights: Callable[[dict], dict] | None = None  # checkpoint tensors -> the names `rules` expects
    # capabilities: what of a ModelConfig the format can hold (check_savable refuses the rest before writing)
    sliding_window: bool = False   # a sliding attention window
    sliding_layers: bool = False   # a window on some layers only
    experts: bool = False          # a mixture of experts
    scale_by_layer: bool = False   # layer i's attention scores scaled by 1 / (i + 1)
