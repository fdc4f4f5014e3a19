"""GRPO's loss as TRL's `GRPOTrainer` (1.16) computes it (DeepSeekMath, Shao et al. 2024, eq. 3 and 4).

For G completions o_1..o_G of one prompt with rewards r_i, tokens t of o_i, and the policy's per-token
log-probabilities (of logits / temperature):

    A_i      = (r_i - mean(r_1..r_G)) / (std(r_1..r_G) + 1e-4)        (std with Bessel's correction; scale_rewards)
    rho_it   = exp(log pi(o_it) - log pi_old(o_it))
    KL_it    = rho_it (exp(ref_it - logp_it) - (ref_it - logp_it) - 1)  (Schulman's k3 estimator, eq. 4, times
               the ratio: TRL's use_bias_correction_kl, on by default; its gradient flows through rho on-policy too)
    l_it     = -min(rho_it A_i, clip(rho_it, 1 - eps_low, 1 + eps_high) A_i) + beta KL_it

and the loss types normalise sum_t l_it m_it (m: the completion mask) as TRL does:
grpo: mean_i (sum_t l m / sum_t m); bnpo: sum l m / sum m over the micro-batch; dr_grpo: sum l m / (B L_max);
dapo: sum l m / the completion tokens of the whole step.
"""
from __future__ import annotations

from dataclasses import dataclass

import torch

from lmkit.objectives import LossSum

LOSS_TYPES = ("grpo", "bnpo", "dr_grpo", "dapo")
SCALE_REWARDS = ("group", "batch", "none")


def nanstd(x: torch.Tensor, dim: int | None = None) -> torch.Tensor:
    """Standard deviation with Bessel's correction, NaNs left out (NaN where fewer than two values)."""
    mean = torch.nanmean(x, dim=dim, keepdim=True) if dim is not None else torch.nanmean(x)
    var = torch.nanmean((x - mean) ** 2, dim=dim) if dim is not None else torch.nanmean((x - mean) ** 2)
    n = (~torch.isnan(x)).sum(dim=dim) if dim is not None else (~torch.isnan(x)).sum()
    return torch.where(n > 1, (var * n / (n - 1).clamp(min=1)).sqrt(), torch.full_like(var, float("nan")))


def group_advantages(rewards: torch.Tensor, group: int, scale: str = "group") -> tuple[torch.Tensor, torch.Tensor]:
    """(advantages, whether each completion's std is zero) of rewards (N,) in consecutive groups of `group`:
    r minus its group's mean, divided by std + 1e-4 of its group ("group"), of all N ("batch"), or not ("none").
    NaN rewards (unscorable completions) stay out of the statistics and get advantage 0."""
    grouped = rewards.view(-1, group)
    mean = torch.nanmean(grouped, dim=1).repeat_interleave(group)
    if scale in ("group", "none"):
        std = nanstd(grouped, dim=1).repeat_interleave(group) if group > 1 else torch.zeros_like(rewards)
    elif scale == "batch":
        std = nanstd(rewards).expand_as(rewards) if rewards.numel() > 1 else torch.zeros_like(rewards)
    else:
        raise ValueError(f"scale_rewards must be one of {SCALE_REWARDS}, got {scale!r}")
    advantages = rewards - mean
    if scale != "none":
        advantages = advantages / (std + 1e-4)
    return torch.nan_to_num(advantages, nan=0.0), torch.isclose(std, torch.zeros_like(std))


def completion_logps(model, prompt_ids: torch.Tensor, prompt_mask: torch.Tensor, completion_ids: torch.Tensor,
                     completion_mask: torch.Tensor, temperature: float = 1.0, positions: bool = True,
                     entropy: bool = False) -> tuple[torch.Tensor, torch.Tensor | None]:
    """log softmax(logits / temperature) of each completion token (B, C) given its left-padded prompt and the
    completion before it (0 on padding), and optionally the entropy of each of those distributions.

    positions: count positions from each row's first real token, as the engine decoded it (False: 0..T-1 over
    the padding too, as a transformers forward without position_ids does)."""
    ids = torch.cat([prompt_ids, completion_ids], dim=1)
    mask = torch.cat([prompt_mask, completion_mask], dim=1)
    kwargs = {"attention_mask": mask}
    if positions:
        kwargs["position_ids"] = (mask.long().cumsum(1) - 1).clamp(min=0)
    C = completion_ids.shape[1]
    out = model(ids, logits_to_keep=C + 1, **kwargs)
    logits = out.logits[:, :-1].float() / temperature
    if not entropy:  # z[token] - logsumexp(z): no (B, C, V) log-softmax to hold
        chosen = logits.gather(-1, completion_ids[..., None])[..., 0]
        return (chosen - torch.logsumexp(logits, dim=-1)) * completion_mask, None
    log_probs = torch.log_softmax(logits, dim=-1)
    logps = log_probs.gather(-1, completion_ids[..., None])[..., 0] * completion_mask
    return logps, -(log_probs.exp() * log_probs).sum(-1).detach()


@dataclass
class Terms:
    """The per-token pieces of the loss (B, C) and the clip flags TRL's metrics count."""

    loss: torch.Tensor
    kl: torch.Tensor | None
    low_clipped: torch.Tensor
    high_clipped: torch.Tensor


def token_terms(logps: torch.Tensor, old_logps: torch.Tensor | None, ref_logps: torch.Tensor | None,
                advantages: torch.Tensor, beta: float, epsilon_low: float, epsilon_high: float,
                delta: float | None = None, bias_correction_kl: bool = True) -> Terms:
    """l_it of the module docstring; old_logps None: the policy that sampled is this one (ratio 1, TRL's
    num_iterations=1); delta: the upper bound on the unclipped ratio (TRL's two-sided clipping);
    bias_correction_kl False: the plain k3 estimate."""
    adv = advantages[:, None] if advantages.dim() == 1 else advantages
    old = logps.detach() if old_logps is None else old_logps
    ratio = torch.exp(logps - old)
    clipped = torch.clamp(ratio, 1 - epsilon_low, 1 + epsilon_high)
    unclipped = ratio if delta is None else torch.clamp(ratio, max=delta)
    loss = -torch.min(unclipped * adv, clipped * adv)
    kl = None
    if beta != 0.0:
        diff = ref_logps - logps
        kl = torch.exp(diff) - diff - 1
        if bias_correction_kl:
            kl = kl * ratio
        loss = loss + beta * kl
    return Terms(loss, kl, (ratio < 1 - epsilon_low) & (adv < 0), (ratio > 1 + epsilon_high) & (adv > 0))


def reduce_loss(per_token: torch.Tensor, mask: torch.Tensor, loss_type: str,
                max_completion_length: int) -> LossSum:
    """The micro-batch's (sum, count) such that the step's sum / count over its micro-batches is TRL's loss for
    `loss_type` (micro-batches of equal size, as TRL's are)."""
    m = mask.to(per_token.dtype)
    total = (per_token * m).sum()
    B = per_token.shape[0]
    if loss_type == "grpo":
        return LossSum(((per_token * m).sum(-1) / m.sum(-1).clamp(min=1.0)).sum(), torch.tensor(B))
    if loss_type == "bnpo":
        return LossSum(total / m.sum().clamp(min=1.0), torch.tensor(1))
    if loss_type == "dr_grpo":
        return LossSum(total / max_completion_length, torch.tensor(B))
    if loss_type == "dapo":
        return LossSum(total, mask.sum())
    raise ValueError(f"loss_type must be one of {LOSS_TYPES}, got {loss_type!r}")


def loss_count(mask: torch.Tensor, loss_type: str) -> int:
    """The count `reduce_loss` gives a micro-batch with this completion mask."""
    return {"grpo": mask.shape[0], "dr_grpo": mask.shape[0], "bnpo": 1}.get(loss_type, int(mask.sum()))


def masked_mean(x: torch.Tensor, mask: torch.Tensor) -> float:
    """Mean of x over the completion tokens (TRL's global_masked_mean in one process)."""
    m = mask.to(torch.float32)
    return float((x.float() * m).sum() / m.sum().clamp(min=1.0))


class GRPOObjective:
    """The loss of a GRPO step for the one loop: batches of prompt_ids/prompt_mask (left-padded),
    completion_ids/completion_mask (right-padded), advantages, and ref_logps (beta != 0) and old_logps (optional).
    `stats` holds the last micro-batch's TRL metrics: kl, entropy, clip_ratio/low_mean, high_mean, region_mean."""

    def __init__(self, loss_type: str = "dapo", beta: float = 0.0, epsilon: float = 0.2,
                 epsilon_high: float | None = None, temperature: float = 1.0, max_completion_length: int = 256,
                 delta: float | None = None):
        if loss_type not in LOSS_TYPES:
            raise ValueError(f"loss_type must be one of {LOSS_TYPES}, got {loss_type!r}")
        self.loss_type, self.beta, self.temperature, self.delta = loss_type, beta, temperature, delta
        self.epsilon_low, self.epsilon_high = epsilon, epsilon if epsilon_high is None else epsilon_high
        self.max_completion_length = max_completion_length
        self.stats: dict[str, float] = {}

    def count(self, batch: dict) -> int:
        return loss_count(batch["completion_mask"], self.loss_type)

    def loss(self, model, batch: dict) -> tuple[LossSum, torch.Tensor | None]:
        mask = batch["completion_mask"]
        logps, entropy = completion_logps(model, batch["prompt_ids"], batch["prompt_mask"], batch["completion_ids"],
                                          mask, self.temperature, entropy=True)
        terms = token_terms(logps, batch.get("old_logps"), batch.get("ref_logps"), batch["advantages"], self.beta,
                            self.epsilon_low, self.epsilon_high, self.delta)
        self.stats = {"entropy": masked_mean(entropy, mask),
                      "clip_ratio/low_mean": masked_mean(terms.low_clipped, mask),
                      "clip_ratio/high_mean": masked_mean(terms.high_clipped, mask),
                      "clip_ratio/region_mean": masked_mean(terms.low_clipped | terms.high_clipped, mask)}
        if terms.kl is not None:
            self.stats["kl"] = masked_mean(terms.kl.detach(), mask)
        return reduce_loss(terms.loss, mask, self.loss_type, self.max_completion_length), None
