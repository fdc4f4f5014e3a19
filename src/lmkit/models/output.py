"""What a model's forward returns: the fields transformers users expect, by name."""
from __future__ import annotations

from dataclasses import dataclass

import torch

from lmkit.nn.attention import KVCache


@dataclass
class ModelOutput:
    logits: torch.Tensor | None = None
    last_hidden_state: torch.Tensor | None = None
    past_key_values: KVCache | None = None
    aux_loss: torch.Tensor | None = None          # mixture-of-experts load-balancing loss, unscaled
    router_logits: tuple[torch.Tensor, ...] | None = None   # per MoE layer (B*T, n_experts)
    encoder_last_hidden_state: torch.Tensor | None = None
    pooler_output: torch.Tensor | None = None
    start_logits: torch.Tensor | None = None      # extractive question answering (B, T)
    end_logits: torch.Tensor | None = None
    nsp_logits: torch.Tensor | None = None        # next-sentence prediction (B, 2) beside MLM logits
    mems: tuple[torch.Tensor, ...] | None = None  # XLNet's memory per layer, time-major (T, B, d)
    loss: torch.Tensor | None = None

    @property
    def prediction_logits(self) -> torch.Tensor | None:
        """BertForPreTraining's name of its masked-LM logits (`logits` beside `nsp_logits`)."""
        return self.logits if self.nsp_logits is not None else None

    @property
    def seq_relationship_logits(self) -> torch.Tensor | None:
        """BertForPreTraining's name of its next-sentence logits."""
        return self.nsp_logits

    def __getitem__(self, key: str):
        return getattr(self, key)
