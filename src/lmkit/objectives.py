"""Training objectives: losses as (sum of nats, count of scored tokens), and what they mean.

Keeping the sum and the count apart (instead of a mean) lets gradient accumulation and
several processes average over exactly the tokens scored: mean = sum_i nats_i / count.
Positions whose target is `IGNORE_INDEX` (padding) enter neither the sum nor the count.
"""
from __future__ import annotations

import math
from dataclasses import dataclass

import torch
import torch.nn.functional as F

IGNORE_INDEX = -100


@dataclass
class LossSum:
    """sum: total negative log-likelihood in nats (a tensor); count: number of tokens scored."""

    sum: torch.Tensor
    count: torch.Tensor

    @property
    def mean(self) -> torch.Tensor:
        """Nats per token: sum / count (0 when nothing was scored)."""
        return self.sum / self.count.clamp(min=1)


def next_token_targets(input_ids: torch.Tensor, attention_mask: torch.Tensor | None = None,
                       ignore_index: int = IGNORE_INDEX) -> tuple[torch.Tensor, torch.Tensor]:
    """(inputs, targets) from rows x_0..x_T that begin with BOS: inputs x_0..x_{T-1}, targets x_1..x_T.

    A target is ignored where attention_mask (B, T + 1) is 0, i.e. at padding.
    """
    inputs, targets = input_ids[:, :-1], input_ids[:, 1:].clone()
    if attention_mask is not None:
        targets[attention_mask[:, 1:] == 0] = ignore_index
    return inputs, targets


def next_token_loss(logits: torch.Tensor, targets: torch.Tensor, ignore_index: int = IGNORE_INDEX) -> LossSum:
    """-sum_t log softmax(logits_t)[y_t] over positions with y_t != ignore_index, in float32.

    logits (B, T, V) are the model's outputs at the input positions; targets (B, T) the next tokens.
    """
    flat = targets.reshape(-1)
    nats = F.cross_entropy(logits.reshape(-1, logits.shape[-1]).float(), flat,
                           ignore_index=ignore_index, reduction="sum")
    return LossSum(nats, (flat != ignore_index).sum())


def perplexity(nats_per_token: float) -> float:
    """exp(mean nats per token); inf when that overflows."""
    try:
        return math.exp(nats_per_token)
    except OverflowError:
        return math.inf


def bits_per_byte(total_nats: float, total_bytes: int) -> float:
    """total nats / (ln 2 * number of UTF-8 bytes of the text scored): tokenizer-independent."""
    if total_bytes <= 0:
        raise ValueError("bits per byte needs at least one byte of text")
    return total_nats / (math.log(2) * total_bytes)


# masked language modelling (BERT, RoBERTa) --------------------------------------------------------

def mask_tokens(input_ids: torch.Tensor, mask_token_id: int, vocab_size: int, special_ids=(),
                attention_mask: torch.Tensor | None = None, mlm_probability: float = 0.15,
                mask_fraction: float = 0.8, random_fraction: float = 0.1, word_starts: torch.Tensor | None = None,
                generator: torch.Generator | None = None,
                ignore_index: int = IGNORE_INDEX) -> tuple[torch.Tensor, torch.Tensor]:
    """BERT's corruption: (inputs, labels) with each eligible position chosen with probability p = 0.15;
    of the chosen, 80% become [MASK], 10% a uniformly random token, 10% stay; labels hold the original id
    at chosen positions and ignore_index elsewhere. Special tokens and padding are never chosen.

    word_starts (B, T) bool turns on whole-word masking: a word (a start and the tokens up to the next
    start) is chosen as a unit with probability p. Called with a fresh generator state per batch, this
    is RoBERTa's dynamic masking: every batch gets new masks.
    """
    ids = input_ids
    eligible = torch.ones_like(ids, dtype=torch.bool)
    if attention_mask is not None:
        eligible &= attention_mask.bool()
    if len(special_ids):
        eligible &= ~torch.isin(ids, torch.as_tensor(list(special_ids), device=ids.device))
    draw = torch.rand(ids.shape, generator=generator, device="cpu").to(ids.device)
    if word_starts is not None:
        # word w of a row takes the draw at column w; every token reads the draw of its word
        word = (torch.cumsum(word_starts.long(), dim=1) - 1).clamp(min=0)
        draw = draw.gather(1, word)
    chosen = (draw < mlm_probability) & eligible
    labels = torch.where(chosen, ids, torch.full_like(ids, ignore_index))
    how = torch.rand(ids.shape, generator=generator, device="cpu").to(ids.device)
    to_mask = chosen & (how < mask_fraction)
    to_random = chosen & (how >= mask_fraction) & (how < mask_fraction + random_fraction)
    random_ids = torch.randint(vocab_size, ids.shape, generator=generator, device="cpu").to(ids.device)
    inputs = torch.where(to_mask, torch.full_like(ids, mask_token_id), ids)
    inputs = torch.where(to_random, random_ids, inputs)
    return inputs, labels


def masked_lm_loss(logits: torch.Tensor, labels: torch.Tensor, ignore_index: int = IGNORE_INDEX) -> LossSum:
    """-sum log softmax(logits_t)[y_t] over the chosen positions only (labels != ignore_index);
    no shift: position t predicts its own original token. mean = sum / number of chosen positions."""
    return next_token_loss(logits, labels, ignore_index)


# next-sentence prediction (BERT) --------------------------------------------------------------------

def next_sentence_pairs(documents: list[list[list[int]]], cls_id: int, sep_id: int, max_len: int,
                        generator: torch.Generator | None = None, random_fraction: float = 0.5):
    """BERT's NSP examples from documents given as lists of sentences (token ids): for each sentence A
    that has a successor, B is that successor (label 0, IsNext) or, with probability random_fraction,
    a sentence of another document (label 1, NotNext). Each example is [CLS] A [SEP] B [SEP] with
    token types 0 for [CLS] A [SEP] and 1 for B [SEP], cut from the ends of the longer part to max_len.

    Returns a list of (input_ids, token_type_ids, label).
    """
    if max_len < 5:
        raise ValueError("next-sentence pairs need max_len >= 5 ([CLS] a [SEP] b [SEP])")
    others = [d for d in range(len(documents)) if documents[d]]
    if len(others) < 2:
        raise ValueError("next-sentence prediction needs at least two non-empty documents for random pairs")
    examples = []
    for d, sentences in enumerate(documents):
        for i in range(len(sentences) - 1):
            a = list(sentences[i])
            if float(torch.rand((), generator=generator)) < random_fraction:
                choices = [o for o in others if o != d]
                o = choices[int(torch.randint(len(choices), (), generator=generator))]
                b, label = list(documents[o][int(torch.randint(len(documents[o]), (), generator=generator))]), 1
            else:
                b, label = list(sentences[i + 1]), 0
            while len(a) + len(b) > max_len - 3:
                (a if len(a) >= len(b) else b).pop()
            ids = [cls_id] + a + [sep_id] + b + [sep_id]
            examples.append((ids, [0] * (len(a) + 2) + [1] * (len(b) + 1), label))
    return examples


def next_sentence_loss(logits: torch.Tensor, labels: torch.Tensor) -> LossSum:
    """-sum log softmax(logits)[label] over pairs (B, 2) logits, count = number of pairs."""
    return LossSum(F.cross_entropy(logits.float(), labels.reshape(-1), reduction="sum"),
                   torch.tensor(labels.numel(), device=labels.device))
