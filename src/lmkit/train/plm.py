"""`--objective plm`: XLNet's permutation language modeling (preset xlnet-tiny), with segment recurrence.

Each row (seq_len tokens of the packed stream) is cut into `segments` consecutive pieces. Piece k is read over the
memory of pieces < k (the layers' inputs, detached: Transformer-XL's recurrence) and gets its own factorization
order (`permutation_lm_inputs`): about 1/6 of its tokens, chosen by spans of 1 to 5, are predicted by the query
stream in that order, the others are visible to all. The loss sums the targets' nats; validation uses one fixed
seeded order and target choice of the held-out rows.
"""
from __future__ import annotations

from typing import Any

import torch

from lmkit.objectives import LossSum, masked_lm_loss, permutation_lm_inputs
from lmkit.train.objective import FixedCorruptionEvaluation, Objective

SEGMENTS = 2        # pieces of each row, read in turn over the memory of the earlier ones
PREDICT_FRACTION = 1 / 6   # K = 6: the last 1/K of each factorization order is predicted
MAX_SPAN = 5


class PermutationLM(FixedCorruptionEvaluation):
    """Batch builder, loss and evaluation of permutation-LM training for one tokenizer."""

    def __init__(self, special_ids: tuple[int, ...], segments: int = SEGMENTS,
                 predict_fraction: float = PREDICT_FRACTION, max_span: int = MAX_SPAN, perm_size: int | None = None):
        self.special_ids, self.segments = special_ids, segments
        self.predict_fraction, self.max_span, self.perm_size = predict_fraction, max_span, perm_size

    def build_batch(self, rows: torch.Tensor, pad_id: int, generator: torch.Generator | None = None) -> dict:
        """input_ids, attention_mask (B, S, T/S) and per piece perm_mask (B, S, T/S, T/S), target_mapping
        (B, S, M, T/S); labels (B, S * M)."""
        rows = rows[:, :-1]  # the stream gives seq_len + 1 tokens for next-token targets; PLM reads seq_len
        B, T = rows.shape
        if T % self.segments:
            rows = rows[:, :T - T % self.segments]
        pieces = rows.reshape(B, self.segments, -1)
        mask = (pieces != pad_id).long()
        parts = [permutation_lm_inputs(pieces[:, s], mask[:, s], self.special_ids + (pad_id,), self.predict_fraction,
                                       self.max_span, self.perm_size, generator) for s in range(self.segments)]
        return {"input_ids": pieces, "attention_mask": mask,
                "perm_mask": torch.stack([p["perm_mask"] for p in parts], dim=1),
                "target_mapping": torch.stack([p["target_mapping"] for p in parts], dim=1),
                "labels": torch.cat([p["labels"] for p in parts], dim=1)}

    def loss(self, model: torch.nn.Module, batch: dict) -> tuple[LossSum, torch.Tensor | None]:
        mems, logits = None, []
        for s in range(batch["input_ids"].shape[1]):
            out = model(batch["input_ids"][:, s], attention_mask=batch["attention_mask"][:, s],
                        perm_mask=batch["perm_mask"][:, s], target_mapping=batch["target_mapping"][:, s], mems=mems,
                        use_mems=True)
            mems = out.mems
            logits.append(out.logits)
        return masked_lm_loss(torch.cat(logits, dim=1), batch["labels"]), None

    def row_tokens(self, batch: dict, row_mask: torch.Tensor) -> int:
        return int(batch["attention_mask"].sum())  # the rows as the model reads them


class PermutationLMObjective(Objective):
    """The registered `plm` objective; `prepare(tokenizer)` gives the one a run trains with."""

    position = "xl"  # trains XLNet models only (the resume check reads this)

    def prepare(self, tokenizer: Any) -> Objective:
        special = tuple(int(i) for i in getattr(tokenizer, "all_special_ids", []) or [])
        task = PermutationLM(special)
        prepared = Objective(self.name, self.architecture, task.build_batch, task.loss, task.evaluate)
        prepared.position = self.position
        return prepared


def _unprepared(*_: Any, **__: Any):
    raise RuntimeError("the plm objective needs prepare(tokenizer) before use")


PLM = PermutationLMObjective("plm", "encoder", _unprepared, _unprepared, _unprepared)
