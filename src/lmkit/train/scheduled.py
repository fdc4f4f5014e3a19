"""Scheduled sampling (Bengio et al. 2015): during training, each input token after the first is, with probability
1 - eps_i, replaced by the model's own prediction of it, eps_i (the teacher-forcing probability of step i) decaying:

    linear:K            eps_i = max(0, 1 - i / K)
    exponential:K       eps_i = K ** i                 (0 < K < 1)
    inverse_sigmoid:K   eps_i = K / (K + exp(i / K))   (K >= 1)

Two passes a step: the teacher-forced inputs give the model's predictions (argmax, no gradient), the mixed inputs
give the loss against the true targets. Decoder-only rows (`--scheduled-sampling` on `lmkit train --objective clm`)
and encoder-decoder targets (`fit_pairs(..., scheduled_sampling=...)`: the decoder's inputs) are mixed alike;
padding and the first input (BOS or the decoder start) are never replaced.
"""
from __future__ import annotations

import math

import torch

from lmkit.errors import ConfigError
from lmkit.objectives import IGNORE_INDEX, LossSum, next_token_loss, shift_right

KINDS = ("linear", "exponential", "inverse_sigmoid")


def parse_schedule(spec: str) -> tuple[str, float]:
    """`KIND:K` -> (kind, k), checked."""
    kind, _, value = str(spec).partition(":")
    try:
        k = float(value)
    except ValueError:
        k = math.nan
    ok = kind in KINDS and math.isfinite(k) and (
        (kind == "linear" and k > 0) or (kind == "exponential" and 0 < k < 1) or (kind == "inverse_sigmoid" and k >= 1))
    if not ok:
        raise ConfigError(f"--scheduled-sampling {spec!r}: give linear:K (K > 0 steps), exponential:K (0 < K < 1) or "
                          "inverse_sigmoid:K (K >= 1), e.g. inverse_sigmoid:100")
    return kind, k


def teacher_forcing_probability(spec: str, step: int) -> float:
    """eps_i of the module docstring at optimizer step `step` (0-based)."""
    kind, k = parse_schedule(spec)
    if kind == "linear":
        return max(0.0, 1.0 - step / k)
    if kind == "exponential":
        return k ** step
    return k / (k + math.exp(min(step / k, 700.0)))


def mix_inputs(inputs: torch.Tensor, predicted: torch.Tensor, keep: torch.Tensor, eps: float) -> torch.Tensor:
    """inputs (B, T) with position t >= 1 replaced by predicted[:, t - 1] (the model's guess of input t from what
    came before) with probability 1 - eps, where keep (B, T) is True (real tokens)."""
    swap = torch.rand(inputs.shape, device="cpu").to(inputs.device) >= eps
    swap[:, 0] = False
    swap &= keep
    out = inputs.clone()
    out[:, 1:] = torch.where(swap[:, 1:], predicted[:, :-1], inputs[:, 1:])
    return out


class ScheduledSampling:
    """A next-token objective (decoder-only rows, or encoder-decoder batches with labels) whose inputs are mixed with
    the model's predictions; the step's eps comes with the batch (`teacher_forcing`, one value per row)."""

    def __init__(self, spec: str, seq2seq: bool = False, start_id: int | None = None, pad_id: int = 0):
        parse_schedule(spec)
        self.spec, self.seq2seq, self.start_id, self.pad_id = spec, seq2seq, start_id, pad_id

    def count(self, batch: dict) -> int:
        return int((batch["labels"] != IGNORE_INDEX).sum())

    def _run(self, model, batch: dict, inputs: torch.Tensor):
        if self.seq2seq:
            return model(batch["input_ids"], attention_mask=batch["attention_mask"], decoder_input_ids=inputs)
        return model(inputs)

    def loss(self, model, batch: dict) -> tuple[LossSum, torch.Tensor | None]:
        labels = batch["labels"]
        if self.seq2seq:
            inputs = shift_right(labels, self.start_id, self.pad_id)
            keep = torch.ones_like(inputs, dtype=torch.bool)
            keep[:, 1:] = labels[:, :-1] != IGNORE_INDEX
        else:
            inputs, keep = batch["input_ids"], torch.ones_like(labels, dtype=torch.bool)
            keep[:, 1:] = labels[:, :-1] != IGNORE_INDEX  # input t is target t - 1: a real token
        eps = float(batch["teacher_forcing"][0])
        if eps < 1.0:
            with torch.no_grad():
                predicted = self._run(model, batch, inputs).logits.argmax(-1)
            inputs = mix_inputs(inputs, predicted, keep, eps)
        out = self._run(model, batch, inputs)
        return next_token_loss(out.logits, labels), getattr(out, "aux_loss", None)
