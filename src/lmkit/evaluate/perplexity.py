"""Perplexity and bits per byte of a causal LM on held-out text.

Every token of every document is scored once (documents longer than the context are cut
into pieces, each read after BOS; or, with a stride, read in overlapping windows so that each
token sees at least context - stride tokens before it): loss = total nats / tokens,
perplexity = exp(loss), bits per byte = total nats / (ln 2 * UTF-8 bytes of the documents).
"""
from __future__ import annotations

import contextlib
from typing import Any

import torch

from lmkit.data.stream import eval_rows, tokenize_corpus
from lmkit.data.tokenize import special_ids
from lmkit.errors import CorpusError
from lmkit.objectives import bits_per_byte, next_token_loss, next_token_targets, perplexity


def autocast(device: torch.device, precision: str):
    """bf16 autocast on `device` for precision "bf16"; nothing for "fp32"."""
    if precision == "bf16":
        return torch.autocast(device_type=device.type, dtype=torch.bfloat16)
    return contextlib.nullcontext()


@torch.no_grad()
def evaluate_rows(model: torch.nn.Module, rows: torch.Tensor, mask: torch.Tensor, num_bytes: int,
                  batch_size: int = 16, precision: str = "fp32") -> dict[str, float]:
    """loss (nats/token), perplexity, bpb, tokens and bytes over rows from `lmkit.data.stream.eval_rows`."""
    was_training = model.training
    model.eval()
    device = next(model.parameters()).device
    total, count = torch.zeros((), dtype=torch.float64), 0
    try:
        for start in range(0, len(rows), batch_size):
            r, m = rows[start:start + batch_size].to(device), mask[start:start + batch_size].to(device)
            inputs, targets = next_token_targets(r, m)
            scored = m.any(0).nonzero()  # trailing columns that score nothing in any row need no compute
            keep = int(scored.max()) + 1 if len(scored) else 0
            if keep < 2:  # rows of BOS alone: no token to score
                continue
            with autocast(device, precision):
                logits = model(inputs[:, :keep - 1]).logits
            ls = next_token_loss(logits, targets[:, :keep - 1])
            total += ls.sum.double().cpu()
            count += int(ls.count)
    finally:
        model.train(was_training)
    if count == 0 or num_bytes <= 0:
        raise CorpusError(f"nothing to score ({count} tokens, {num_bytes} bytes); give held-out text that is not empty")
    loss = float(total) / count
    return {"loss": loss, "perplexity": perplexity(loss), "bpb": bits_per_byte(float(total), num_bytes),
            "tokens": count, "bytes": num_bytes}


def evaluate_text(model: torch.nn.Module, tokenizer: Any, corpus, seq_len: int | None = None,
                  batch_size: int = 16, precision: str = "fp32", max_docs: int | None = None,
                  stride: int | None = None) -> dict[str, float]:
    """evaluate_rows over the documents of `corpus` (an `lmkit.data.Corpus`), tokenized by `tokenizer`;
    `stride` scores with overlapping windows (`lmkit.data.stream.strided_rows`)."""
    bos, pad = special_ids(tokenizer, model.config)
    seq_len = seq_len or model.config.max_seq_len
    rows, mask, nbytes = eval_rows(tokenize_corpus(corpus, tokenizer), bos, pad, seq_len, max_docs, stride)
    return evaluate_rows(model, rows, mask, nbytes, batch_size=batch_size, precision=precision)
