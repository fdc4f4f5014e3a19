"""XLNet's sequence summary: one vector per sequence for classification and multiple choice.

summary(H) = dropout_last(act(W pick(dropout_first(H)) + b)), pick: the last position ("last", XLNet's <cls> at the
end), the first ("first"), the mean ("mean") or the position cls_index names ("cls_index", default the last);
W maps d -> d, or is left out without summary_use_proj; act is tanh
or none. The settings live in config.task.summary under transformers' names.
"""
from __future__ import annotations

import torch
from torch import nn

from lmkit.config import ModelConfig
from lmkit.errors import ConfigError
from lmkit.nn.dropout import Dropout

SUMMARY_TYPES = ("last", "first", "mean", "cls_index")
SUMMARY_DEFAULTS = {"summary_type": "last", "summary_use_proj": True, "summary_activation": "tanh",
                    "summary_proj_to_labels": False, "summary_first_dropout": 0.0, "summary_last_dropout": 0.1}
SUMMARY_ACTIVATIONS = {"tanh": torch.tanh, "linear": None, None: None}


def summary_settings(config: ModelConfig) -> dict:
    settings = {**SUMMARY_DEFAULTS, **config.task.get("summary", {})}
    if settings["summary_type"] not in SUMMARY_TYPES:
        raise ConfigError(f"summary_type {settings['summary_type']!r} is not supported; choose one of "
                          f"{', '.join(SUMMARY_TYPES)}")
    if settings["summary_activation"] not in SUMMARY_ACTIVATIONS:
        raise ConfigError(f"summary_activation {settings['summary_activation']!r} is not supported; use 'tanh' or "
                          "none")
    if settings["summary_proj_to_labels"]:  # XLNet's logits_proj then meets num_labels features instead of d_model
        raise ConfigError("summary_proj_to_labels=true does not fit XLNet's logits_proj (transformers' model fails on "
                          "it too); set it to false")
    return settings


class SequenceSummary(nn.Module):
    """dropout(act(W pick(H) + b)) by the summary settings of config.task.summary."""

    def __init__(self, config: ModelConfig):
        super().__init__()
        s = summary_settings(config)
        self.kind = s["summary_type"]
        self.summary = nn.Linear(config.d_model, config.d_model) if s["summary_use_proj"] else None
        self.act = SUMMARY_ACTIVATIONS[s["summary_activation"]]
        self.first_dropout = Dropout(s["summary_first_dropout"] or 0.0)
        self.last_dropout = Dropout(s["summary_last_dropout"] or 0.0)

    def forward(self, h: torch.Tensor, cls_index: torch.Tensor | None = None) -> torch.Tensor:
        if self.kind == "last":
            x = h[:, -1]
        elif self.kind == "first":
            x = h[:, 0]
        elif self.kind == "mean":
            x = h.mean(dim=1)
        else:
            index = torch.full(h.shape[:1], h.shape[1] - 1, device=h.device) if cls_index is None else cls_index
            x = h[torch.arange(h.shape[0], device=h.device), index.reshape(-1)]
        x = self.first_dropout(x)
        if self.summary is not None:
            x = self.summary(x)
        if self.act is not None:
            x = self.act(x)
        return self.last_dropout(x)
