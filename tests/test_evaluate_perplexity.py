"""Perplexity and bits per byte of evaluate_rows against a hand computation, row by row without padding."""
from __future__ import annotations

import math

import pytest
import torch

from lmkit.config import get_preset
from lmkit.errors import LmkitError
from lmkit.evaluate.perplexity import evaluate_rows
from lmkit.models import build_model


@pytest.fixture(scope="module")
def model():
    torch.manual_seed(0)
    return build_model(get_preset("tiny", vocab_size=50, d_model=32, n_layers=1, n_heads=2, max_seq_len=16)).eval()


def _rows(lens, width=9):
    g = torch.Generator().manual_seed(1)
    rows, mask = torch.zeros((len(lens), width), dtype=torch.long), torch.zeros((len(lens), width), dtype=torch.long)
    for i, n in enumerate(lens):  # BOS (1), then n - 1 tokens, right-padded with 0
        rows[i, 0], mask[i, :n] = 1, 1
        rows[i, 1:n] = torch.randint(2, 50, (n - 1,), generator=g)
    return rows, mask


def test_loss_is_token_weighted_mean_and_bpb_total_nats(model):
    lens = [9, 3, 2, 9, 5, 1, 7]  # very unequal rows (one BOS alone) so a mean of batch means would differ
    rows, mask = _rows(lens)
    total, count = 0.0, 0
    with torch.no_grad():
        for i, n in enumerate(lens):
            if n > 1:
                logp = torch.log_softmax(model(rows[i:i + 1, :n - 1]).logits.double(), -1)[0]
                total -= float(logp[torch.arange(n - 1), rows[i, 1:n]].sum())
                count += n - 1
    for batch_size in (1, 2, 3, 16):
        r = evaluate_rows(model, rows, mask, 123, batch_size=batch_size)
        assert r["tokens"] == count == 29
        assert r["loss"] == pytest.approx(total / count, rel=1e-6)
        assert r["perplexity"] == pytest.approx(math.exp(total / count), rel=1e-6)
        assert r["bpb"] == pytest.approx(total / math.log(2) / 123, rel=1e-6)


def test_nothing_to_score_is_a_clear_error(model):
    rows, mask = _rows([1, 1])
    with pytest.raises(LmkitError, match="nothing to score"):
        evaluate_rows(model, rows, mask, 10)
    with pytest.raises(LmkitError, match="nothing to score"):
        evaluate_rows(model, rows[:0], mask[:0], 0)


def test_evaluate_text_reads_a_tokenizer_without_a_pad_token(model):
    """GPT-2's own tokenizer has <|endoftext|> but no <|pad|>: padding is masked, so the numbers do not change."""
    from lmkit.data.corpus import Corpus, Document
    from lmkit.evaluate.perplexity import evaluate_text
    from lmkit.tokenizers import train_tokenizer

    texts = ["def f(x):\n    return x + 1\n" * 3, "a short one", "class A:\n    pass\n" * 5]
    corpus = Corpus("small", [Document(f"d{i}", t) for i, t in enumerate(texts)])
    with_pad = train_tokenizer(texts, kind="char", vocab_size=50, special_tokens=["<|endoftext|>", "<|pad|>"])
    without = train_tokenizer(texts, kind="char", vocab_size=50, special_tokens=["<|endoftext|>", "<pad>"])
    a = evaluate_text(model, with_pad, corpus, seq_len=16)
    b = evaluate_text(model, without, corpus, seq_len=16)
    assert a == pytest.approx(b)
