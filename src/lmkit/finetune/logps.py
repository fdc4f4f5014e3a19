"""Log-probabilities of completions under a causal LM, as TRL's trainers take them (DPO, GRPO, reward checks).

    token_logps[b, t] = log p(ids[b, t + 1] | ids[b, :t + 1]) = z[ids[b, t + 1]] - logsumexp(z),  z = logits[b, t]
    sequence_logps[b] = sum over t of token_logps[b, t] * completion_mask[b, t + 1]
"""
from __future__ import annotations

import torch
from torch import nn


def token_logps(logits: torch.Tensor, input_ids: torch.Tensor) -> torch.Tensor:
    """(B, T - 1) log-probabilities, in float32, of each next token given the ones before it."""
    z = logits[:, :-1].float()
    return z.gather(-1, input_ids[:, 1:, None]).squeeze(-1) - torch.logsumexp(z, dim=-1)


def sequence_logps(logits: torch.Tensor, input_ids: torch.Tensor, completion_mask: torch.Tensor) -> torch.Tensor:
    """(B,) per-sequence completion log-probability: token_logps summed over the positions completion_mask marks."""
    return (token_logps(logits, input_ids) * completion_mask[:, 1:].to(torch.float32)).sum(dim=1)


def completion_logps(model: nn.Module, batch: dict) -> torch.Tensor:
    """(B,) summed completion log-probabilities of a right-padded batch (input_ids, attention_mask,
    completion_mask) under `model`; gradients flow unless the caller disables them."""
    out = model(batch["input_ids"], attention_mask=batch["attention_mask"])
    return sequence_logps(out.logits, batch["input_ids"], batch["completion_mask"])
