"""Training objectives: losses as (sum of nats, count of scored tokens), and what they mean.

Keeping the sum and the count apart (instead of a mean) lets gradient accumulation and
several processes average over exactly the tokens scored: mean = sum_i nats_i / count.
Positions whose target is `IGNORE_INDEX` (padding) enter neither the sum nor the count.
"""
from __future__ import annotations

import math
from dataclasses import dataclass

import torch
import torch.nn.functional as F

IGNORE_INDEX = -100


@dataclass
class LossSum:
    """sum: total negative log-likelihood in nats (a tensor); count: number of tokens scored."""

    sum: torch.Tensor
    count: torch.Tensor

    @property
    def mean(self) -> torch.Tensor:
        """Nats per token: sum / count (0 when nothing was scored)."""
        return self.sum / self.count.clamp(min=1)


def next_token_targets(input_ids: torch.Tensor, attention_mask: torch.Tensor | None = None,
                       ignore_index: int = IGNORE_INDEX) -> tuple[torch.Tensor, torch.Tensor]:
    """(inputs, targets) from rows x_0..x_T that begin with BOS: inputs x_0..x_{T-1}, targets x_1..x_T.

    A target is ignored where attention_mask (B, T + 1) is 0, i.e. at padding.
    """
    inputs, targets = input_ids[:, :-1], input_ids[:, 1:].clone()
    if attention_mask is not None:
        targets[attention_mask[:, 1:] == 0] = ignore_index
    return inputs, targets


def next_token_loss(logits: torch.Tensor, targets: torch.Tensor, ignore_index: int = IGNORE_INDEX) -> LossSum:
    """-sum_t log softmax(logits_t)[y_t] over positions with y_t != ignore_index, in float32.

    logits (B, T, V) are the model's outputs at the input positions; targets (B, T) the next tokens.
    """
    flat = targets.reshape(-1)
    nats = F.cross_entropy(logits.reshape(-1, logits.shape[-1]).float(), flat,
                           ignore_index=ignore_index, reduction="sum")
    return LossSum(nats, (flat != ignore_index).sum())


def perplexity(nats_per_token: float) -> float:
    """exp(mean nats per token); inf when that overflows."""
    try:
        return math.exp(nats_per_token)
    except OverflowError:
        return math.inf


def bits_per_byte(total_nats: float, total_bytes: int) -> float:
    """total nats / (ln 2 * number of UTF-8 bytes of the text scored): tokenizer-independent."""
    if total_bytes <= 0:
        raise ValueError("bits per byte needs at least one byte of text")
    return total_nats / (math.log(2) * total_bytes)
