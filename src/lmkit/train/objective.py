"""A pre-training objective (`--objective NAME`): a batch builder, a loss, a count and an evaluation.

An `Objective` turns the raw token rows of a step into model inputs (`build_batch`, which may
use the step's seeded generator, e.g. for masking), says how many targets they score
(`count`), computes the summed loss (`loss`), and evaluates a model on validation data. It is the
one training loop's objective (lmkit.train.job.Objective: count and loss) with what pre-training adds;
the registry of names is lmkit.train.objectives.
"""
from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Any, Callable

import torch

from lmkit.evaluate.perplexity import autocast, evaluate_rows
from lmkit.objectives import IGNORE_INDEX, LossSum, next_token_loss, next_token_targets, perplexity


@dataclass
class Objective:
    name: str
    architecture: str  # the ModelConfig.architecture it trains
    build_batch: Callable[[torch.Tensor, int, torch.Generator], dict[str, torch.Tensor]]  # rows, pad_id, generator
    # (summed loss, the model's unscaled load-balancing aux_loss or None; the trainer adds coef * aux_loss)
    loss: Callable[[torch.nn.Module, dict[str, torch.Tensor]], tuple[LossSum, torch.Tensor | None]]
    evaluate: Callable[..., dict[str, float]]

    def count(self, batch: dict[str, torch.Tensor]) -> int:
        """Number of targets the batch scores (the loss divides by the whole step's count)."""
        return int((batch["labels"] != IGNORE_INDEX).sum())


# next-token prediction (causal LM) ----------------------------------------------------------------

def clm_batch(rows: torch.Tensor, pad_id: int, generator: torch.Generator | None = None) -> dict[str, torch.Tensor]:
    """Rows x_0..x_T (x_0 = BOS) -> input_ids x_0..x_{T-1} and labels x_1..x_T (padding ignored)."""
    mask = (rows != pad_id).long()
    inputs, labels = next_token_targets(rows, mask)
    return {"input_ids": inputs, "labels": labels}


def clm_loss(model: torch.nn.Module, batch: dict[str, torch.Tensor]) -> tuple[LossSum, torch.Tensor | None]:
    out = model(batch["input_ids"])
    return next_token_loss(out.logits, batch["labels"]), getattr(out, "aux_loss", None)


def _clm_evaluate(model: torch.nn.Module, **kwargs: Any) -> dict[str, float]:
    return evaluate_rows(model, **kwargs)


CLM = Objective("clm", "decoder", clm_batch, clm_loss, _clm_evaluate)


class FixedCorruptionEvaluation:
    """Validation of a corrupting objective (MLM, span, denoise): its loss under one seeded corruption.

    The class using it supplies `build_batch`, `loss`, `eval_seed` and `row_tokens(batch, row_mask)`
    (how many tokens of the rows the scored targets stand for). bpb scales the bytes by scored targets
    / row tokens, so it is not comparable with a causal model's bpb.
    """

    eval_seed = 1234

    def row_tokens(self, batch: dict, row_mask: torch.Tensor) -> int:
        return int(row_mask.sum())

    @torch.no_grad()
    def evaluate(self, model: torch.nn.Module, rows: torch.Tensor, mask: torch.Tensor, num_bytes: int,
                 batch_size: int = 16, precision: str = "fp32", **_: Any) -> dict[str, float]:
        was_training = model.training
        model.eval()
        device = next(model.parameters()).device
        generator = torch.Generator().manual_seed(self.eval_seed)
        # the rows' padding, else the model's pad id: corrupted sources differ in length even when no row is padded
        pad = int(rows[mask == 0][0]) if bool((mask == 0).any()) else model.config.pad_token_id
        total, count, tokens = 0.0, 0, 0
        try:
            for start in range(0, len(rows), batch_size):
                batch = self.build_batch(rows[start:start + batch_size].to(device), pad, generator)
                with autocast(device, precision):
                    ls = self.loss(model, batch)[0]
                total += float(ls.sum)
                count += int(ls.count)
                tokens += self.row_tokens(batch, mask[start:start + batch_size])
        finally:
            model.train(was_training)
        loss = total / max(count, 1)
        scored_bytes = num_bytes * min(1.0, count / max(tokens, 1))
        return {"loss": loss, "perplexity": perplexity(loss), "bpb": total / (math.log(2) * max(scored_bytes, 1e-9)),
                "tokens": count, "bytes": num_bytes}
