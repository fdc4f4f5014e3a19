"""The objective registry: what `--objective NAME` trains, as a batch builder plus a loss.

An `Objective` turns the raw token rows of a step into model inputs (`build_batch`, which may
use the step's seeded generator, e.g. for masking), says how many targets they score
(`count`), computes the summed loss (`loss`), and evaluates a model on validation data.
Register new ones with `register_objective`; the trainer needs nothing else.
"""
from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Any, Callable

import torch

from lmkit.errors import TrainingError
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
    return evaluate_rows(model, **kwargs)


register_objective(Objective("clm", "decoder", clm_batch, clm_loss, _clm_evaluate))



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


def evaluate_corpus(model: torch.nn.Module, tokenizer: Any, corpus: Any, objective: str, seq_len: int | None = None,
                    batch_size: int = 16) -> dict[str, float]:
    """The validation numbers an `objective` run (mlm, span, denoise, plm) reports on `corpus`: the loss of the
    tokens its fixed corruption of the rows hides or asks for."""
    size = vocab_size_of(tokenizer)
    task = get_objective(objective).prepare(tokenizer)
    if vocab_size_of(tokenizer) != size:  # prepare added the tokens a run gets: this model never learned them
        raise TrainingError(f"the tokenizer has no {'sentinel tokens' if objective == 'span' else 'mask token'} for "
                            f"--objective {objective} (a training run adds its own), so a model trained without "
                            "it cannot be scored on that corruption; use the tokenizer the model was trained with")
    bos, pad = special_ids(tokenizer)
    rows, mask, nbytes = eval_rows(tokenize_corpus(corpus, tokenizer), bos, pad, seq_len or model.config.max_seq_len)
    return task.evaluate(model, rows=rows, mask=mask, num_bytes=nbytes, batch_size=batch_size)


from lmkit.train import masked as _masked  # noqa: E402,F401  (registers "mlm")
from lmkit.train import denoise as _denoise  # noqa: E402,F401  (registers "span" and "denoise")
from lmkit.train import plm as _plm  # noqa: E402,F401  (registers "plm")
from lmkit.evaluate.perplexity import autocast, evaluate_rows
from lmkit.data.stream import eval_rows, tokenize_corpus
from lmkit.data.tokenize import special_ids, vocab_size_of
