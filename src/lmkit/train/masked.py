"""`--objective mlm`: masked-language-model training of encoders (BERT, RoBERTa presets).

The run's tokenizer gets a `<|mask|>` special token (`prepare`, called once the tokenizer exists).
Each step's rows (BOS-led pieces of the packed stream, cut to seq_len) are corrupted afresh with
the step's seeded generator: 15% of the non-special positions chosen, 80/10/10 [MASK]/random/kept
(RoBERTa's dynamic masking, repeatable per seed and step). The loss is summed over chosen positions
only and divided by their count. Validation uses one fixed masking of the held-out rows.
"""
from __future__ import annotations

from typing import Any

import torch

from lmkit.data.tokenize import vocab_size_of
from lmkit.objectives import LossSum, mask_tokens, masked_lm_loss, word_starts
from lmkit.train.objective import FixedCorruptionEvaluation, Objective

MASK = "<|mask|>"


class MaskedLM(FixedCorruptionEvaluation):
    """Batch builder, loss and evaluation of masked-LM training for one tokenizer."""

    def __init__(self, mask_id: int, vocab_size: int, special_ids: tuple[int, ...], mlm_probability: float = 0.15,
                 words: tuple[torch.Tensor, torch.Tensor] | None = None):
        """words: the (begins, ends) tables of `lmkit.tokenizers.words.word_boundaries` for whole-word masking."""
        self.mask_id, self.vocab_size, self.special_ids = mask_id, vocab_size, special_ids
        self.mlm_probability, self.words = mlm_probability, words

    def build_batch(self, rows: torch.Tensor, pad_id: int, generator: torch.Generator | None = None) -> dict:
        rows = rows[:, :-1]  # the stream gives seq_len + 1 tokens for next-token targets; MLM reads seq_len
        mask = (rows != pad_id).long()
        starts = word_starts(rows, *self.words) if self.words is not None else None
        inputs, labels = mask_tokens(rows, self.mask_id, self.vocab_size, self.special_ids + (pad_id,), mask,
                                     mlm_probability=self.mlm_probability, word_starts=starts, generator=generator)
        return {"input_ids": inputs, "attention_mask": mask, "labels": labels}

    def loss(self, model: torch.nn.Module, batch: dict) -> tuple[LossSum, torch.Tensor | None]:
        out = model(batch["input_ids"], attention_mask=batch["attention_mask"])
        return masked_lm_loss(out.logits, batch["labels"]), getattr(out, "aux_loss", None)

    def row_tokens(self, batch: dict, row_mask: torch.Tensor) -> int:
        return int(batch["attention_mask"].sum())  # the rows as the model reads them (seq_len, not seq_len + 1)


class MaskedLMObjective(Objective):
    """The registered `mlm` objective; `prepare(tokenizer)` gives the one a run trains with."""

    def prepare(self, tokenizer: Any) -> Objective:
        """The objective for `tokenizer`: its own mask token (a pretrained folder's [MASK] or <mask>), else
        `<|mask|>`, added as a special token when missing."""
        mask_id = getattr(tokenizer, "mask_token_id", None)
        if mask_id is None:
            if tokenizer.token_to_id(MASK) is None:
                tokenizer.add_special_tokens([MASK])
            mask_id = tokenizer.token_to_id(MASK)

        special = tuple(int(i) for i in getattr(tokenizer, "all_special_ids", []) or [mask_id])
        task = MaskedLM(int(mask_id), vocab_size_of(tokenizer), special)
        return Objective(self.name, self.architecture, task.build_batch, task.loss, task.evaluate)


def _unprepared(*_: Any, **__: Any):
    raise RuntimeError("the mlm objective needs prepare(tokenizer) before use")


MLM = MaskedLMObjective("mlm", "encoder", _unprepared, _unprepared, _unprepared)
