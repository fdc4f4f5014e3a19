"""`--objective mlm-nsp`: BERT's pre-training, masked LM and next-sentence prediction together, as transformers'
`BertForPreTraining` computes it: loss = mean CE over the masked tokens + mean CE of IsNext/NotNext over the pairs.

Each row of the packed stream starts at a piece of one document (data/stream.py). The pair of a row is
[CLS] A [SEP] B [SEP] (token types 0 for [CLS] A [SEP], 1 for B [SEP]), padded to seq_len: A is the start of the
row's piece, cut at a uniformly drawn point; with probability 1/2 B is the rest of that piece (IsNext, label 0),
else a segment of the same length from the piece of another row of the batch (NotNext, label 1). Rows are drawn at
random over the corpus, so another row's piece is another document's unless both came from one long document
(docs/limits.md). Then BERT's 15% masking (80/10/10) over A and B, never [CLS], [SEP] or padding.
"""
from __future__ import annotations

from typing import Any

import torch
import torch.nn.functional as F

from lmkit.data.tokenize import special_ids, vocab_size_of
from lmkit.errors import TrainingError
from lmkit.objectives import IGNORE_INDEX, LossSum, masked_lm_loss
from lmkit.train.masked import MaskedLM, frame_pairs, mask_token_id
from lmkit.train.objective import Objective

SEP = "<|sep|>"
NOT_NEXT = 1  # transformers' next_sentence_label: 0 IsNext, 1 NotNext


def first_piece(row: list[int], bos: int, pad: int) -> list[int]:
    """The tokens of a BOS-led row up to the next BOS or padding: one piece of one document."""
    piece = []
    for t in row[1:]:
        if t in (bos, pad):
            break
        piece.append(t)
    return piece


def sentence_pairs(rows: torch.Tensor, cls_id: int, sep_id: int, pad_id: int, seq_len: int,
                   generator: torch.Generator | None = None) -> dict[str, torch.Tensor]:
    """input_ids, token_type_ids, attention_mask (B, seq_len) and next_sentence_label (B,) of the rows' pairs
    (module docstring); rows (B, >= 1) each begin with BOS. Pieces under 2 tokens give a shorter pair."""
    if seq_len < 5:
        raise TrainingError(f"--objective mlm-nsp needs --seq-len 5 or more ([CLS] A [SEP] B [SEP]), got {seq_len}")
    if len(rows) < 2:
        raise TrainingError("--objective mlm-nsp draws NotNext segments from the other rows of a batch, and this "
                            "batch has one row per process; use --batch-size 2 or more per process")
    room = seq_len - 3
    table = rows.tolist()
    bos = table[0][0]
    pieces = [first_piece(r, bos, pad_id) for r in table]
    B = len(table)
    draws = torch.rand(B, 2, generator=generator).tolist()
    others = torch.randint(B - 1, (B,), generator=generator).tolist()
    ids = torch.full((B, seq_len), pad_id, dtype=torch.long)
    types, mask = torch.zeros_like(ids), torch.zeros_like(ids)
    labels = torch.zeros(B, dtype=torch.long)
    for b, piece in enumerate(pieces):
        usable = piece[:room]
        cut = 1 + int(draws[b][0] * max(len(usable) - 1, 1)) if len(usable) > 1 else len(usable)
        a, rest = usable[:cut], usable[cut:]
        if draws[b][1] < 0.5 or not rest:
            pair_b, label = rest, 0
        else:
            other = pieces[others[b] + (others[b] >= b)]
            start = int(torch.randint(max(len(other) - len(rest), 0) + 1, (), generator=generator))
            pair_b, label = other[start:start + len(rest)], NOT_NEXT
        row = [cls_id, *a, sep_id, *pair_b, sep_id]
        ids[b, :len(row)] = torch.tensor(row)
        types[b, len(a) + 2:len(row)] = 1
        mask[b, :len(row)] = 1
        labels[b] = label
    return {"input_ids": ids, "token_type_ids": types, "attention_mask": mask, "next_sentence_label": labels}


class MaskedLMNextSentence(MaskedLM):
    """Batch builder, loss and evaluation of mlm-nsp for one tokenizer."""

    def __init__(self, mask_id: int, vocab_size: int, special_ids: tuple[int, ...], cls_id: int, sep_id: int):
        super().__init__(mask_id, vocab_size, special_ids)
        self.cls_id, self.sep_id = cls_id, sep_id

    def build_batch(self, rows: torch.Tensor, pad_id: int, generator: torch.Generator | None = None) -> dict:
        """The rows' pairs (`sentence_pairs`), masked; nsp_weight (B,) = masked tokens / pairs of the whole batch, so
        that the loop's sum / (masked tokens) is mean MLM + mean NSP however the step is cut into micro-batches."""
        device = rows.device
        pairs = sentence_pairs(rows.cpu(), self.cls_id, self.sep_id, pad_id, rows.shape[1] - 1, generator)
        inputs, labels = self.mask(pairs["input_ids"], pairs["attention_mask"], pad_id, generator,
                                   (self.cls_id, self.sep_id))
        weight = float((labels != IGNORE_INDEX).sum()) / len(labels)
        batch = {**pairs, "input_ids": inputs, "labels": labels, "nsp_weight": torch.full((len(labels),), weight)}
        return {k: v.to(device) for k, v in batch.items()}

    def forward(self, model: torch.nn.Module, batch: dict):
        return model(batch["input_ids"], attention_mask=batch["attention_mask"], token_type_ids=batch["token_type_ids"])

    def loss(self, model: torch.nn.Module, batch: dict) -> tuple[LossSum, torch.Tensor | None]:
        out = self.forward(model, batch)
        mlm = masked_lm_loss(out.logits, batch["labels"])
        nsp = F.cross_entropy(out.nsp_logits.float(), batch["next_sentence_label"], reduction="none")
        return LossSum(mlm.sum + (nsp * batch["nsp_weight"]).sum(), mlm.count), getattr(out, "aux_loss", None)

    def measure(self, model: torch.nn.Module, batch: dict) -> dict[str, tuple[float, int]]:
        """The masked tokens' loss and accuracy (MaskedLM.measure), and the pairs' NSP loss and accuracy."""
        out = self.forward(model, batch)
        labels, nsp_labels = batch["labels"], batch["next_sentence_label"]
        ls = masked_lm_loss(out.logits, labels)
        chosen = labels != IGNORE_INDEX
        right = int((out.logits.argmax(-1)[chosen] == labels[chosen]).sum())
        nsp = float(F.cross_entropy(out.nsp_logits.float(), nsp_labels, reduction="sum"))
        nsp_right = int((out.nsp_logits.argmax(-1) == nsp_labels).sum())
        n = len(nsp_labels)
        return {"masked_loss": (float(ls.sum), int(ls.count)), "masked_accuracy": (right, int(ls.count)),
                "nsp_loss": (nsp, n), "nsp_accuracy": (nsp_right, n)}


class NextSentenceObjective(Objective):
    """The registered `mlm-nsp` objective; it trains an encoder with BERT's pre-training head (MLM + NSP)."""

    head = "pretraining"

    def prepare(self, tokenizer: Any) -> Objective:
        """The objective for `tokenizer`: its mask token, its [CLS] (else the BOS rows start with) and its [SEP]
        (else `<|sep|>`, added as a special token)."""
        mask_id = mask_token_id(tokenizer)
        sep_id = getattr(tokenizer, "sep_token_id", None)
        if sep_id is None:
            if tokenizer.token_to_id(SEP) is None:
                tokenizer.add_special_tokens([SEP])
            sep_id = tokenizer.token_to_id(SEP)
        cls_id = getattr(tokenizer, "cls_token_id", None)
        cls_id = special_ids(tokenizer)[0] if cls_id is None else cls_id
        frame_pairs(tokenizer, int(cls_id), int(sep_id))
        special = tuple(int(i) for i in getattr(tokenizer, "all_special_ids", []) or [mask_id])
        task = MaskedLMNextSentence(mask_id, vocab_size_of(tokenizer), special, int(cls_id), int(sep_id))
        prepared = NextSentenceObjective(self.name, self.architecture, task.build_batch, task.loss, task.evaluate)
        prepared.task = task
        return prepared


def _unprepared(*_: Any, **__: Any):
    raise RuntimeError("the mlm-nsp objective needs prepare(tokenizer) before use")


MLM_NSP = NextSentenceObjective("mlm-nsp", "encoder", _unprepared, _unprepared, _unprepared)
