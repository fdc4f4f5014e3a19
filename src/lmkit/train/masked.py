"""`--objective mlm`: masked-language-model training of encoders (BERT, RoBERTa presets).

The run's tokenizer gets a `<|mask|>` special token (`prepare`, called once the tokenizer exists).
Each step's rows (BOS-led pieces of the packed stream, cut to seq_len) are corrupted afresh with
the step's seeded generator: 15% of the non-special positions chosen, 80/10/10 [MASK]/random/kept
(RoBERTa's dynamic masking, repeatable per seed and step). The loss is summed over chosen positions
only and divided by their count. Validation uses one fixed masking of the held-out rows and reports the
masked loss and the masked-token accuracy under those names: a masked LM's loss over ~15% of the tokens,
each predicted from both sides, is no perplexity of the text, and no bits per byte.
"""
from __future__ import annotations

from typing import Any

import torch

from lmkit.data.tokenize import special_ids, vocab_size_of
from lmkit.evaluate.perplexity import autocast
from lmkit.objectives import IGNORE_INDEX, LossSum, mask_tokens, masked_lm_loss, word_starts
from lmkit.tokenizers.processors import bert_template
from lmkit.train.objective import Objective

MASK = "<|mask|>"


def mask_token_id(tokenizer: Any) -> int:
    """The tokenizer's own mask token (a pretrained folder's [MASK] or <mask>), else `<|mask|>`, added as a special
    token when missing."""
    mask_id = getattr(tokenizer, "mask_token_id", None)
    if mask_id is None:
        if tokenizer.token_to_id(MASK) is None:
            tokenizer.add_special_tokens([MASK])
        mask_id = tokenizer.token_to_id(MASK)
    return int(mask_id)


def frame_pairs(tokenizer: Any, cls_id: int, sep_id: int) -> None:
    """Give a run's own tokenizer (one without a post-processor) BERT's template (`bert_template`) over the ids
    pre-training framed its rows with, and those [CLS]/[SEP] roles, so that a fine-tune encodes a text and a pair as
    `[CLS] A [SEP] B [SEP]` with segment ids. A tokenizer with a post-processor of its own (a pretrained folder's)
    keeps it. Only the saved frame changes: the packed stream encodes without special tokens."""
    if getattr(tokenizer, "post_processor", True) is not None:
        return
    tokenizer.post_processor = bert_template(tokenizer.id_to_token(cls_id), cls_id, tokenizer.id_to_token(sep_id), sep_id)
    if tokenizer.cls_token_id is None:
        tokenizer.cls_token_id = cls_id
    if tokenizer.sep_token_id is None:
        tokenizer.sep_token_id = sep_id


def eval_batches(n: int, batch_size: int) -> list[tuple[int, int]]:
    """(start, end) ranges of batch_size rows; a lone last row joins the batch before it (a pair objective draws
    its NotNext segments from the other rows of a batch)."""
    bounds = list(range(0, n, max(batch_size, 2))) + [n]
    if len(bounds) > 2 and bounds[-1] - bounds[-2] == 1:
        bounds.pop(-2)
    return list(zip(bounds, bounds[1:]))


class MaskedLM:
    """Batch builder, loss and evaluation of masked-LM training for one tokenizer."""

    eval_seed = 1234

    def __init__(self, mask_id: int, vocab_size: int, special_ids: tuple[int, ...], mlm_probability: float = 0.15,
                 words: tuple[torch.Tensor, torch.Tensor] | None = None):
        """words: the (begins, ends) tables of `lmkit.tokenizers.words.word_boundaries` for whole-word masking."""
        self.mask_id, self.vocab_size, self.special_ids = mask_id, vocab_size, special_ids
        self.mlm_probability, self.words = mlm_probability, words

    def mask(self, rows: torch.Tensor, mask: torch.Tensor, pad_id: int, generator: torch.Generator | None,
             extra_special: tuple[int, ...] = ()) -> tuple[torch.Tensor, torch.Tensor]:
        starts = word_starts(rows, *self.words) if self.words is not None else None
        return mask_tokens(rows, self.mask_id, self.vocab_size, self.special_ids + extra_special + (pad_id,), mask,
                           mlm_probability=self.mlm_probability, word_starts=starts, generator=generator)

    def build_batch(self, rows: torch.Tensor, pad_id: int, generator: torch.Generator | None = None) -> dict:
        rows = rows[:, :-1]  # the stream gives seq_len + 1 tokens for next-token targets; MLM reads seq_len
        mask = (rows != pad_id).long()
        inputs, labels = self.mask(rows, mask, pad_id, generator)
        return {"input_ids": inputs, "attention_mask": mask, "labels": labels}

    def loss(self, model: torch.nn.Module, batch: dict) -> tuple[LossSum, torch.Tensor | None]:
        out = model(batch["input_ids"], attention_mask=batch["attention_mask"])
        return masked_lm_loss(out.logits, batch["labels"]), getattr(out, "aux_loss", None)

    def measure(self, model: torch.nn.Module, batch: dict) -> dict[str, tuple[float, int]]:
        """{name: (sum, count)} of one batch: the masked tokens' nats and how many the model's argmax gets right."""
        out = model(**{k: v for k, v in batch.items() if k in ("input_ids", "attention_mask", "token_type_ids")})
        labels = batch["labels"]
        ls = masked_lm_loss(out.logits, labels)
        chosen = labels != IGNORE_INDEX
        right = int((out.logits.argmax(-1)[chosen] == labels[chosen]).sum())
        return {"masked_loss": (float(ls.sum), int(ls.count)), "masked_accuracy": (right, int(ls.count))}

    @torch.no_grad()
    def evaluate(self, model: torch.nn.Module, rows: torch.Tensor, mask: torch.Tensor, num_bytes: int,
                 batch_size: int = 16, precision: str = "fp32", **_: Any) -> dict[str, float]:
        """Means of `measure` over the held-out rows under one seeded masking; `loss` is what training
        minimises (the masked loss, plus the NSP loss for mlm-nsp)."""
        was_training = model.training
        model.eval()
        device = next(model.parameters()).device
        generator = torch.Generator().manual_seed(self.eval_seed)
        pad = int(rows[mask == 0][0]) if bool((mask == 0).any()) else model.config.pad_token_id
        sums: dict[str, list[float]] = {}
        try:
            for start, end in eval_batches(len(rows), batch_size):
                batch = self.build_batch(rows[start:end].to(device), pad, generator)
                with autocast(device, precision):
                    measured = self.measure(model, batch)
                for name, (total, count) in measured.items():
                    acc = sums.setdefault(name, [0.0, 0])
                    acc[0] += total
                    acc[1] += count
        finally:
            model.train(was_training)
        result = {name: total / max(count, 1) for name, (total, count) in sums.items()}
        result["loss"] = sum(v for k, v in result.items() if k.endswith("_loss"))
        return {**result, "tokens": int(sums["masked_loss"][1]), "bytes": num_bytes}


class MaskedLMObjective(Objective):
    """The registered `mlm` objective; `prepare(tokenizer)` gives the one a run trains with."""

    def prepare(self, tokenizer: Any) -> Objective:
        """The objective for `tokenizer`, with its mask token (`mask_token_id`)."""
        mask_id = mask_token_id(tokenizer)
        # rows are BOS-led pieces with BOS between documents: BOS is both the frame's [CLS] and its [SEP]
        bos = special_ids(tokenizer)[0]
        sep = getattr(tokenizer, "sep_token_id", None)
        frame_pairs(tokenizer, bos, bos if sep is None else int(sep))
        special = tuple(int(i) for i in getattr(tokenizer, "all_special_ids", []) or [mask_id])
        task = MaskedLM(mask_id, vocab_size_of(tokenizer), special)
        return Objective(self.name, self.architecture, task.build_batch, task.loss, task.evaluate)


def _unprepared(*_: Any, **__: Any):
    raise RuntimeError("the mlm objective needs prepare(tokenizer) before use")


MLM = MaskedLMObjective("mlm", "encoder", _unprepared, _unprepared, _unprepared)
