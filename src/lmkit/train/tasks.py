"""The objective registry: what `--objective NAME` trains, as a batch builder plus a loss.

An `Objective` turns the raw token rows of a step into model inputs (`build_batch`, which may
use the step's seeded generator, e.g. for masking), says how many targets they score
(`count`), computes the summed loss (`loss`), and evaluates a model on validation data.
Register new ones with `register_objective`; the trainer needs nothing else.
"""
from __future__ import annotations

from dataclasses import dataclass
from typing import Any, Callable

import torch

from lmkit.errors import TrainingError
from lmkit.objectives import IGNORE_INDEX, LossSum, next_token_loss, next_token_targets


@dataclass
class Objective:
    name: str
    architecture: str  # the ModelConfig.architecture it trains
    build_batch: Callable[[torch.Tensor, int, torch.Generator], dict[str, torch.Tensor]]  # rows, pad_id, generator
    loss: Callable[[torch.nn.Module, dict[str, torch.Tensor]], tuple[LossSum, torch.Tensor | None]]
    evaluate: Callable[..., dict[str, float]]

    def count(self, batch: dict[str, torch.Tensor]) -> int:
        """Number of targets the batch scores (the loss divides by the whole step's count)."""
        return int((batch["labels"] != IGNORE_INDEX).sum())


OBJECTIVES: dict[str, Objective] = {}
PLANNED = ("mlm", "span", "denoise")


def register_objective(objective: Objective) -> None:
    OBJECTIVES[objective.name] = objective


def get_objective(name: str) -> Objective:
    if name not in OBJECTIVES:
        if name in PLANNED:
            raise TrainingError(f"--objective {name} is not available yet; use --objective clm")
        raise TrainingError(f"unknown objective {name!r}; choose one of {', '.join(OBJECTIVES)}")
    return OBJECTIVES[name]


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
    from lmkit.evaluate.perplexity import evaluate_rows

    return evaluate_rows(model, **kwargs)


register_objective(Objective("clm", "decoder", clm_batch, clm_loss, _clm_evaluate))

from lmkit.train import masked as _masked  # noqa: E402,F401  (registers "mlm")
from lmkit.train import denoise as _denoise  # noqa: E402,F401  (registers "span" and "denoise")
