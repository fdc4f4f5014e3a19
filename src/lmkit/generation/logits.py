"""Logit processors, applied in transformers' order: repetition penalty, n-gram blocking, then
temperature, top-k and top-p (nucleus) for sampling.

Each takes (sequences (B, T), scores (B, V) float32) and returns new scores.
"""
from __future__ import annotations

import torch

NEG_INF = -float("inf")


def repetition_penalty(sequences: torch.Tensor, scores: torch.Tensor, penalty: float,
                       prompt_padding: torch.Tensor | None = None) -> torch.Tensor:
    """CTRL's penalty: a seen token's logit is divided by `penalty` if positive, multiplied if negative.

    As in transformers, the first prompt_padding[b] positions of row b (its left padding) are not seen."""
    vocab = scores.shape[-1]
    if prompt_padding is not None:
        positions = torch.arange(sequences.shape[1], device=sequences.device)
        sequences = sequences.masked_fill(positions < prompt_padding[:, None], vocab)
    padded = torch.nn.functional.pad(scores, (0, 1))  # column `vocab` absorbs the skipped positions
    sequences = sequences.clamp(max=vocab)
    seen = torch.gather(padded, 1, sequences)
    seen = torch.where(seen < 0, seen * penalty, seen / penalty)
    return padded.scatter(1, sequences, seen)[:, :vocab]


def no_repeat_ngram(sequences: torch.Tensor, scores: torch.Tensor, n: int) -> torch.Tensor:
    """Forbid any token that would complete an n-gram already present in the row."""
    length = sequences.shape[1]
    if length + 1 < n:
        return scores
    scores = scores.clone()
    for row, seq in enumerate(sequences.tolist()):
        prefix = tuple(seq[length - n + 1:])
        banned = [seq[i + n - 1] for i in range(length - n + 1) if tuple(seq[i:i + n - 1]) == prefix]
        if banned:
            scores[row, banned] = NEG_INF
    return scores


def top_k_filter(scores: torch.Tensor, k: int, min_keep: int = 1) -> torch.Tensor:
    """Keep the max(k, min_keep) largest logits of each row (ties at the last value kept), -inf elsewhere."""
    k = min(max(k, min_keep, 1), scores.shape[-1])
    threshold = torch.topk(scores, k)[0][..., -1, None]
    return scores.masked_fill(scores < threshold, NEG_INF)


def top_p_filter(scores: torch.Tensor, p: float, min_keep: int = 1) -> torch.Tensor:
    """Keep the smallest set of most likely tokens whose probability reaches p (at least min_keep)."""
    sorted_logits, sorted_indices = torch.sort(scores, descending=False)
    cumulative = sorted_logits.softmax(dim=-1).cumsum(dim=-1)
    remove_sorted = cumulative <= (1 - p)
    remove_sorted[..., -max(min_keep, 1):] = False
    remove = remove_sorted.scatter(1, sorted_indices, remove_sorted)
    return scores.masked_fill(remove, NEG_INF)


def process(sequences: torch.Tensor, scores: torch.Tensor, *, do_sample: bool, temperature: float,
            top_k: int | None, top_p: float | None, repetition: float, no_repeat_ngram_size: int,
            prompt_padding: torch.Tensor | None = None, min_keep: int = 1) -> torch.Tensor:
    """All processors the arguments ask for, in transformers' order (prompt_padding: left pads per row;
    min_keep: the fewest tokens top-k and top-p leave)."""
    if repetition != 1.0:
        scores = repetition_penalty(sequences, scores, repetition, prompt_padding)
    if no_repeat_ngram_size:
        scores = no_repeat_ngram(sequences, scores, no_repeat_ngram_size)
    if do_sample:
        if temperature != 1.0:
            scores = scores / temperature
        if top_k:
            scores = top_k_filter(scores, top_k, min_keep)
        if top_p is not None and top_p < 1.0:
            scores = top_p_filter(scores, top_p, min_keep)
    return scores


def force_tokens(scores: torch.Tensor, cur_len: int, max_length: int, bos: int | None = None,
                 eos: list[int] | tuple = ()) -> torch.Tensor:
    """transformers' forced BOS / EOS: after a one-token sequence only `bos` may come; the token that
    reaches max_length must be an EOS. The forced tokens get score 0, all others -inf."""
    if bos is not None and cur_len == 1:
        scores = torch.full_like(scores, NEG_INF)
        scores[:, bos] = 0
    if eos and cur_len == max_length - 1:
        scores = torch.full_like(scores, NEG_INF)
        scores[:, list(eos)] = 0
    return scores
