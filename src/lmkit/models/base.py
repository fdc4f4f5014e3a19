"""What every lmkit model shares: the config, weight init, and saving in Hugging Face format."""
from __future__ import annotations

import importlib
from typing import Callable

import torch
from torch import nn

from lmkit.config import ModelConfig

# Hugging Face folders are written by lmkit.hub, the layer above the models (it builds models to load them): the hub
# registers its writer when imported, and a model saved before anything imported the hub imports it by this name.
FOLDER_WRITER_MODULE = "lmkit.hub"
_folder_writer: list[Callable] = []


def register_folder_writer(write: Callable) -> None:
    """Make `write(model, path)` what `PreTrainedModel.save_pretrained` calls."""
    _folder_writer[:] = [write]


def folder_writer() -> Callable:
    if not _folder_writer:
        importlib.import_module(FOLDER_WRITER_MODULE)
    return _folder_writer[0]


class PreTrainedModel(nn.Module):
    """A torch module built from a `ModelConfig`, saved and loaded as a Hugging Face folder."""

    def __init__(self, config: ModelConfig):
        super().__init__()
        self.config = config

    def init_weights(self) -> None:
        """Normal(0, init_std) for linear and embedding weights, zeros for biases, ones for norm gains.

        Output projections of residual branches get std / sqrt(2 * n_layers) (GPT-2's scaled init).
        """
        std = self.config.init_std
        n_layers = self.config.n_layers + (self.config.n_decoder_layers or 0)
        for name, module in self.named_modules():
            if isinstance(module, nn.Linear):
                scaled = name.endswith(("o_proj", "down_proj"))
                nn.init.normal_(module.weight, std=std / (2 * n_layers) ** 0.5 if scaled else std)
                if module.bias is not None:
                    nn.init.zeros_(module.bias)
            elif isinstance(module, nn.Embedding):
                nn.init.normal_(module.weight, std=std)

    @property
    def device(self) -> torch.device:
        return next(self.parameters()).device

    @property
    def dtype(self) -> torch.dtype:
        return next(self.parameters()).dtype

    def num_parameters(self, trainable_only: bool = False) -> int:
        """Number of distinct parameters (tied weights counted once)."""
        seen = {id(p): p for p in self.parameters() if p.requires_grad or not trainable_only}
        return sum(p.numel() for p in seen.values())

    def save_pretrained(self, path, safe_serialization: bool = True) -> None:
        """Write config.json and model.safetensors that transformers loads with the matching class."""
        folder_writer()(self, path)
