"""The objective registry: what `--objective NAME` trains (clm, mlm, mlm-nsp, span, denoise, plm, fim; train/objective.py says
what an objective is). Register new ones with `register_objective`; the trainer needs nothing else.
"""
from __future__ import annotations

from typing import Any

import torch

from lmkit.data.stream import eval_rows, tokenize_corpus
from lmkit.data.tokenize import special_ids, vocab_size_of
from lmkit.errors import TrainingError
from lmkit.train.denoise import DENOISE, SPAN
from lmkit.train.fim import FIM
from lmkit.train.masked import MLM
from lmkit.train.nsp import MLM_NSP
from lmkit.train.objective import CLM, Objective, clm_batch, clm_loss
from lmkit.train.plm import PLM

__all__ = ["OBJECTIVES", "Objective", "clm_batch", "clm_loss", "evaluate_corpus", "get_objective",
           "register_objective"]

OBJECTIVES: dict[str, Objective] = {o.name: o for o in (CLM, MLM, MLM_NSP, SPAN, DENOISE, PLM, FIM)}
PLANNED = ("mlm", "span", "denoise")
MISSING = {"span": "sentinel tokens", "fim": "sentinel tokens", "mlm-nsp": "mask or separator token"}  # what prepare adds


def register_objective(objective: Objective) -> None:
    OBJECTIVES[objective.name] = objective


def get_objective(name: str) -> Objective:
    if name not in OBJECTIVES:
        if name in PLANNED:
            raise TrainingError(f"--objective {name} is not available yet; use --objective clm")
        raise TrainingError(f"unknown objective {name!r}; choose one of {', '.join(OBJECTIVES)}")
    return OBJECTIVES[name]


def evaluate_corpus(model: torch.nn.Module, tokenizer: Any, corpus: Any, objective: str, seq_len: int | None = None,
                    batch_size: int = 16, noise: str | None = None) -> dict[str, float]:
    """The validation numbers an `objective` run (mlm, mlm-nsp, span, denoise, plm) reports on `corpus`: the loss of
    the tokens its fixed corruption of the rows hides or asks for (mlm, mlm-nsp: and the masked-token accuracy)."""
    size = vocab_size_of(tokenizer)
    task = get_objective(objective).prepare(tokenizer, **({"noise": noise} if noise is not None else {}))
    if vocab_size_of(tokenizer) != size:  # prepare added the tokens a run gets: this model never learned them
        raise TrainingError(f"the tokenizer has no {MISSING.get(objective, 'mask token')} for "
                            f"--objective {objective} (a training run adds its own), so a model trained without "
                            "it cannot be scored on that corruption; use the tokenizer the model was trained with")
    bos, pad = special_ids(tokenizer)
    rows, mask, nbytes = eval_rows(tokenize_corpus(corpus, tokenizer), bos, pad, seq_len or model.config.max_seq_len)
    return task.evaluate(model, rows=rows, mask=mask, num_bytes=nbytes, batch_size=batch_size)
