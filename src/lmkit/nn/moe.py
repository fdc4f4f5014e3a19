"""Mixture-of-experts feed-forward (Switch Transformer / Mixtral).

A router W_r scores each token x over N experts; the token goes to its top k experts and
y = sum_{e in topk} g_e E_e(x), with g = softmax over the chosen logits only, which equals
Mixtral's softmax over all N followed by top-k and renormalisation (exp(l_e) / sum_chosen exp(l_j)).
Load balancing (Switch Transformer eq. 4-6, transformers' form): L = N * sum_e f_e P_e, where
f_e = (number of top-k assignments to e) / tokens and P_e = mean router probability of e.
`aux_loss` = router_aux_loss_coef * L is what the training loss adds; the model sums it over layers
(transformers pools the counts of all layers before the product: the same number for one layer).
"""
from __future__ import annotations

import math

import torch
import torch.nn.functional as F
from torch import nn

from lmkit.config import ModelConfig
from lmkit.nn.ffn import FeedForward


def load_balancing_loss(probs: torch.Tensor, chosen: torch.Tensor, n_experts: int) -> torch.Tensor:
    """N * sum_e f_e P_e for router probabilities (tokens, N) and chosen experts (tokens, k).

    With a uniform router it is k (its minimum over routers whose choices follow their probabilities).
    """
    tokens = probs.shape[0]
    counts = torch.zeros(n_experts, dtype=torch.float32, device=probs.device)
    counts = counts.scatter_add_(0, chosen.reshape(-1), torch.ones(chosen.numel(), device=probs.device))
    f = counts / tokens
    p = probs.float().mean(dim=0)
    return n_experts * (f * p).sum()


class MoEFeedForward(nn.Module):
    """Router `gate` (d -> N, no bias) and N SwiGLU/GeLU experts `experts.{e}` (each a `FeedForward`).

    expert_capacity_factor c (optional): each expert takes at most ceil(c * tokens * k / N)
    assignments, first choices before second choices, earlier tokens first; the rest are dropped
    (their share of the output is zero, the residual carries the token on).
    """

    def __init__(self, config: ModelConfig):
        super().__init__()
        self.n_experts = config.n_experts
        self.top_k = config.n_experts_per_token
        self.capacity_factor = config.expert_capacity_factor
        self.coef = config.router_aux_loss_coef
        self.gate = nn.Linear(config.d_model, config.n_experts, bias=False)
        self.experts = nn.ModuleList(FeedForward(config) for _ in range(config.n_experts))
        self.aux_loss: torch.Tensor | None = None
        self.balance_loss: torch.Tensor | None = None

    def route(self, x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor]:
        """(logits, probs, weights, chosen) for tokens x (n, d): weights (n, k) sum to 1 per token."""
        logits = self.gate(x)
        probs = F.softmax(logits.float(), dim=-1)
        weights, chosen = torch.topk(probs, self.top_k, dim=-1)
        weights = weights / weights.sum(dim=-1, keepdim=True)
        return logits, probs, weights, chosen

    def capacity_mask(self, chosen: torch.Tensor) -> torch.Tensor | None:
        """(n, k) True where the assignment fits its expert's capacity; None without a capacity."""
        if self.capacity_factor is None:
            return None
        n, k = chosen.shape
        capacity = math.ceil(self.capacity_factor * n * k / self.n_experts)
        order = chosen.t().reshape(-1)                           # slot-major: all first choices first
        onehot = F.one_hot(order, self.n_experts)
        position = (onehot.cumsum(0) * onehot).sum(-1) - 1       # place in its expert's queue
        return (position < capacity).view(k, n).t()

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        shape = x.shape
        flat = x.reshape(-1, shape[-1])
        _, probs, weights, chosen = self.route(flat)
        keep = self.capacity_mask(chosen)
        out = torch.zeros_like(flat)
        for e, expert in enumerate(self.experts):
            hit = chosen == e
            if keep is not None:
                hit = hit & keep
            token, slot = torch.where(hit)
            if token.numel() == 0:
                continue
            y = expert(flat[token]) * weights[token, slot, None]
            out.index_add_(0, token, y.to(out.dtype))
        self.balance_loss = load_balancing_loss(probs, chosen, self.n_experts)
        self.aux_loss = self.coef * self.balance_loss
        return out.view(shape)
