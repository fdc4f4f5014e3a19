"""Mixture-of-experts feed-forward (Switch Transformer / Mixtral).

A router W_r scores each token x over N experts; the token goes to its top k experts and
y = sum_{e in topk} g_e E_e(x), with g = softmax over all N in float32, then top-k, then
renormalised over the chosen k (transformers' MixtralTopKRouter, in that order).
Load balancing (Switch Transformer eq. 4-6, transformers' `load_balancing_loss_func`):
L = N * sum_e f_e P_e, where over the real (unpadded) tokens of all MoE layers pooled together
f_e = (top-k assignments to e) / rows and P_e = mean router probability of e. transformers 4.39+
(layers concatenated) and 5.x (layers accumulated) give this number; older 4.x counted or mis-masked padding.
L is the models' unscaled `aux_loss`; CausalLM's `loss` adds router_aux_loss_coef * L when
output_router_logits is set (as MixtralForCausalLM), and the trainers add it to every step's loss once.
Router jitter (training only): x * U(1 - j, 1 + j) before routing, the experts see the jittered x too.
"""
from __future__ import annotations

import math
from collections.abc import Sequence

import torch
import torch.nn.functional as F
from torch import nn

from lmkit.config import ModelConfig
from lmkit.nn.ffn import FeedForward


def load_balancing_loss(router_logits: Sequence[torch.Tensor] | torch.Tensor, n_experts: int, top_k: int,
                        attention_mask: torch.Tensor | None = None) -> torch.Tensor:
    """N * sum_e f_e P_e over layers' router logits (each (rows, N), rows = B*T) and a (B, T) 0/1 mask.

    f_e and P_e pool every layer's real rows, as transformers does; with a uniform router and balanced
    choices L = k, its minimum over routers whose choices follow their probabilities.
    """
    if torch.is_tensor(router_logits):
        router_logits = (router_logits,)
    device = router_logits[0].device
    counts = torch.zeros(n_experts, dtype=torch.float32, device=device)
    prob_sum = torch.zeros(n_experts, dtype=torch.float32, device=device)
    rows = torch.zeros((), dtype=torch.float32, device=device)
    weight = None if attention_mask is None else attention_mask.reshape(-1).to(device, torch.float32)
    for logits in router_logits:
        probs = F.softmax(logits, dim=-1)        # in the logits' dtype, as transformers' loss does
        chosen = torch.topk(probs, top_k, dim=-1).indices
        if weight is None:
            w = torch.ones(logits.shape[0], dtype=torch.float32, device=device)
        elif weight.numel() != logits.shape[0]:
            raise ValueError(f"attention mask has {weight.numel()} entries for {logits.shape[0]} router rows")
        else:
            w = weight
        counts = counts.scatter_add(0, chosen.reshape(-1), w.repeat_interleave(top_k))
        prob_sum = prob_sum + (probs.float() * w[:, None]).sum(0)
        rows = rows + w.sum()
    return n_experts * ((counts / rows) * (prob_sum / rows)).sum()


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
        self.jitter = float(config.router_jitter_noise or 0.0)
        self.gate = nn.Linear(config.d_model, config.n_experts, bias=False)
        self.experts = nn.ModuleList(FeedForward(config) for _ in range(config.n_experts))
        self.router_logits: torch.Tensor | None = None   # (tokens, N) of the last forward, for the loss

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
        if self.training and self.jitter > 0:   # Mixtral's router jitter: x * U(1 - j, 1 + j), training only
            x = x * torch.empty_like(x).uniform_(1.0 - self.jitter, 1.0 + self.jitter)
        flat = x.reshape(-1, shape[-1])
        self.router_logits, _, weights, chosen = self.route(flat)
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
        return out.view(shape)
