"""Knowledge distillation, DistilBERT's recipe (Sanh et al. 2019).

loss = alpha * CE(student, labels) + beta * T^2 * KL(softmax(z_t / T) || softmax(z_s / T))
       + gamma * (1 - cos(h_s, h_t)),
each term a mean over the scored positions; T^2 keeps the soft-target gradients on the scale of
the hard ones (Hinton et al. 2015). The student starts from every other layer of the teacher.
"""
from __future__ import annotations

import math
import re
from dataclasses import dataclass

import torch
import torch.nn.functional as F
from torch import nn

from lmkit.config import sliding_fields
from lmkit.errors import ConfigError
from lmkit.finetune.clm import train_causal_lm
from lmkit.objectives import LossSum
from lmkit.train.objective import clm_batch

_LAYER = re.compile(r"^(.*?(?:^|\.)layers\.)(\d+)(\..*)$")


@dataclass
class DistillWeights:
    """DistilBERT's defaults: alpha (labels) 2, beta (soft targets) 5, gamma (hidden cosine) 1, T = 2."""

    alpha: float = 2.0
    beta: float = 5.0
    gamma: float = 1.0
    temperature: float = 2.0

    def __post_init__(self):
        if not (math.isfinite(self.temperature) and self.temperature > 0):
            raise ConfigError(f"the distillation temperature must be a number > 0 (softmax(z / T)), got {self.temperature}")
        for name in ("alpha", "beta", "gamma"):
            value = getattr(self, name)
            if not (math.isfinite(value) and value >= 0):
                raise ConfigError(f"the distillation weight {name} must be a number >= 0, got {value}")


def _wide(x: torch.Tensor) -> torch.Tensor:
    """At least float32 (half-precision logits are widened; float64 ones are kept)."""
    return x.to(torch.promote_types(x.dtype, torch.float32))


def distillation_loss(student_logits: torch.Tensor, teacher_logits: torch.Tensor, labels: torch.Tensor | None = None,
                      student_hidden: torch.Tensor | None = None, teacher_hidden: torch.Tensor | None = None,
                      weights: DistillWeights | None = None, ignore_index: int = -100) -> dict[str, torch.Tensor]:
    """{loss, ce, kl, cos}; logits (..., V) at the same positions as labels (...); positions whose label is
    ignore_index enter no term. Without labels every position is scored and the CE term is zero."""
    w = weights or DistillWeights()
    V = student_logits.shape[-1]
    s, t = _wide(student_logits.reshape(-1, V)), _wide(teacher_logits.reshape(-1, V))
    keep = torch.ones(s.shape[0], dtype=torch.bool, device=s.device)
    zero = s.new_zeros(())
    ce = zero
    if labels is not None:
        flat = labels.reshape(-1)
        keep = flat != ignore_index
        ce = F.cross_entropy(s, flat, ignore_index=ignore_index) if bool(keep.any()) else zero
    n = keep.sum().clamp(min=1)
    T = w.temperature
    # sum p_t (log p_t - log p_s) with 0 log 0 = 0, so a teacher's -inf logit (p_t = 0) adds nothing
    kl = F.kl_div(F.log_softmax(s[keep] / T, -1), F.softmax(t[keep] / T, -1), reduction="sum") / n
    cos = zero
    if w.gamma and student_hidden is not None and teacher_hidden is not None:
        hs = _wide(student_hidden.reshape(-1, student_hidden.shape[-1]))[keep]
        ht = _wide(teacher_hidden.reshape(-1, teacher_hidden.shape[-1]))[keep]
        cos = (1 - F.cosine_similarity(hs, ht, dim=-1)).sum() / n
    loss = w.alpha * ce + w.beta * T * T * kl + w.gamma * cos
    return {"loss": loss, "ce": ce, "kl": kl, "cos": cos}


def layer_counts(model: nn.Module) -> dict[str, int]:
    """Number of blocks in each stack, by the prefix of its parameter names (`decoder.layers.`)."""
    counts: dict[str, int] = {}
    for name in model.state_dict():
        m = _LAYER.match(name)
        if m:
            counts[m.group(1)] = max(counts.get(m.group(1), 0), int(m.group(2)) + 1)
    return counts


def student_from_teacher(teacher: nn.Module, every: int = 2) -> nn.Module:
    """A model of the teacher's class with blocks 0, every, 2 every, ... of each stack, copied from it."""
    if every < 1:
        raise ConfigError(f"every must be >= 1, got {every}")
    counts = layer_counts(teacher)
    keep = {prefix: list(range(0, n, every)) for prefix, n in counts.items()}
    cfg = teacher.config
    changes = {}
    for prefix, kept in keep.items():
        # the decoder stack of an encoder-decoder model is sized by n_decoder_layers
        field = "n_decoder_layers" if cfg.architecture == "encoder-decoder" and prefix.startswith("decoder") else "n_layers"
        changes[field] = len(kept)
    if cfg.sliding_layers is not None and "decoder.layers." in keep:  # the kept blocks keep their windows
        kept = keep["decoder.layers."]
        changes.update(sliding_fields(cfg.sliding_window, [cfg.layer_window(i) is not None for i in kept]))
    student = type(teacher)(cfg.replace(**changes))
    state = {}
    for name, tensor in teacher.state_dict().items():
        m = _LAYER.match(name)
        if m is None:
            state[name] = tensor
        elif int(m.group(2)) in keep[m.group(1)]:
            state[f"{m.group(1)}{keep[m.group(1)].index(int(m.group(2)))}{m.group(3)}"] = tensor
    student.load_state_dict(state)
    teacher_weight = next(teacher.parameters())
    return student.to(teacher_weight.device, teacher_weight.dtype).train(teacher.training)


class DistillationObjective:
    """The student's loss against a frozen teacher on next-token rows: `distillation_loss` over the scored
    positions, as a sum (mean x count) so that micro-batches and ranks weigh every position once."""

    build_batch = staticmethod(clm_batch)

    def __init__(self, teacher: nn.Module, weights: DistillWeights | None = None):
        self.teacher, self.weights, self.parts = teacher.eval(), weights or DistillWeights(), {}

    def count(self, batch: dict[str, torch.Tensor]) -> int:
        return int((batch["labels"] != -100).sum())

    def loss(self, model: nn.Module, batch: dict[str, torch.Tensor]) -> tuple[LossSum, torch.Tensor | None]:
        out = model(batch["input_ids"])
        with torch.no_grad():
            ref = self.teacher(batch["input_ids"])
        parts = distillation_loss(out.logits, ref.logits, batch["labels"], out.last_hidden_state, ref.last_hidden_state,
                                  self.weights)
        n = (batch["labels"] != -100).sum()
        self.parts = {k: float(parts[k].detach()) for k in ("ce", "kl", "cos")}  # logged with the step
        return LossSum(parts["loss"] * n, n), getattr(out, "aux_loss", None)


def distill_causal_lm(teacher: nn.Module, student: nn.Module, stream, pad_id: int, steps: int, batch_size: int,
                      lr: float = 1e-3, warmup_steps: int = 20, weights: DistillWeights | None = None, seed: int = 0,
                      weight_decay: float = 0.1, grad_clip: float = 1.0, log=None, **run) -> list[dict]:
    """Train `student` on rows of a `PackedStream` against the frozen teacher; returns the logged rows.
    `run`: the loop's settings of `train_causal_lm` (out, precision, lr_schedule, save_every, resume)."""
    return train_causal_lm(student, stream, pad_id, steps, batch_size, lr, warmup_steps, seed, weight_decay,
                           grad_clip, DistillationObjective(teacher, weights), log, **run)
