"""`--objective mlm`: masked-language-model training of encoders (BERT, RoBERTa presets).

The run's tokenizer gets a `<|mask|>` special token (`prepare`, called once the tokenizer exists).
Each step's rows (BOS-led pieces of the packed stream, cut to seq_len) are corrupted afresh with
the step's seeded generator: 15% of the non-special positions chosen, 80/10/10 [MASK]/random/kept
(RoBERTa's dynamic masking, repeatable per seed and step). The loss is summed over chosen positions
only and divided by their count. Validation uses one fixed masking of the held-out rows.
"""
from __future__ import annotations

import math
from typing import Any

import torch

from lmkit.evaluate.perplexity import autocast
from lmkit.objectives import IGNORE_INDEX, LossSum, mask_tokens, masked_lm_loss, perplexity
from lmkit.train.tasks import Objective, register_objective

MASK = "<|mask|>"
EVAL_SEED = 1234


class MaskedLM:
    """Batch builder, loss and evaluation of masked-LM training for one tokenizer."""

    def __init__(self, mask_id: int, vocab_size: int, special_ids: tuple[int, ...], mlm_probability: float = 0.15):
        self.mask_id, self.vocab_size, self.special_ids = mask_id, vocab_size, special_ids
        self.mlm_probability = mlm_probability

    def build_batch(self, rows: torch.Tensor, pad_id: int, generator: torch.Generator | None = None) -> dict:
        rows = rows[:, :-1]  # the stream gives seq_len + 1 tokens for next-token targets; MLM reads seq_len
        mask = (rows != pad_id).long()
        inputs, labels = mask_tokens(rows, self.mask_id, self.vocab_size, self.special_ids + (pad_id,), mask,
                                     mlm_probability=self.mlm_probability, generator=generator)
        return {"input_ids": inputs, "attention_mask": mask, "labels": labels}

    def loss(self, model: torch.nn.Module, batch: dict) -> tuple[LossSum, torch.Tensor | None]:
        out = model(batch["input_ids"], attention_mask=batch["attention_mask"])
        return masked_lm_loss(out.logits, batch["labels"]), getattr(out, "aux_loss", None)

    @torch.no_grad()
    def evaluate(self, model: torch.nn.Module, rows: torch.Tensor, mask: torch.Tensor, num_bytes: int,
                 batch_size: int = 16, precision: str = "fp32", **_: Any) -> dict[str, float]:
        """Masked-token loss (nats per chosen token) on the held-out rows under one fixed masking.

        bpb scales the bytes by the share of tokens scored (bits per byte of the masked text, taking
        masked tokens to be as long as the average token): not comparable with a causal model's bpb.
        """
        was_training = model.training
        model.eval()
        device = next(model.parameters()).device
        generator = torch.Generator().manual_seed(EVAL_SEED)
        total, count, tokens = 0.0, 0, 0
        pad = int(rows[mask == 0][0]) if bool((mask == 0).any()) else -1
        try:
            for start in range(0, len(rows), batch_size):
                r = rows[start:start + batch_size].to(device)
                batch = self.build_batch(r, pad, generator)
                with autocast(device, precision):
                    ls = self.loss(model, batch)[0]
                total += float(ls.sum)
                count += int(ls.count)
                tokens += int(batch["attention_mask"].sum())
        finally:
            model.train(was_training)
        loss = total / max(count, 1)
        scored_bytes = num_bytes * count / max(tokens, 1)
        return {"loss": loss, "perplexity": perplexity(loss), "bpb": total / (math.log(2) * max(scored_bytes, 1e-9)),
                "tokens": count, "bytes": num_bytes}


class MaskedLMObjective(Objective):
    """The registered `mlm` objective; `prepare(tokenizer)` gives the one a run trains with."""

    def prepare(self, tokenizer: Any) -> Objective:
        if tokenizer.token_to_id(MASK) is None:
            tokenizer.add_special_tokens([MASK])
        from lmkit.data.tokenize import vocab_size_of

        special = tuple(int(i) for i in getattr(tokenizer, "all_special_ids", []) or [tokenizer.token_to_id(MASK)])
        task = MaskedLM(int(tokenizer.token_to_id(MASK)), vocab_size_of(tokenizer), special)
        return Objective(self.name, self.architecture, task.build_batch, task.loss, task.evaluate)


def _unprepared(*_: Any, **__: Any):
    raise RuntimeError("the mlm objective needs prepare(tokenizer) before use")


register_objective(MaskedLMObjective("mlm", "encoder", _unprepared, _unprepared, _unprepared))
