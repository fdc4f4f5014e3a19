"""Encoder-decoder objectives: teacher forcing, T5 span corruption, BART infilling, deletion, permutation."""
from __future__ import annotations

import torch

from lmkit.objectives import (IGNORE_INDEX, next_token_loss, random_spans_noise_mask, sentence_permutation,
                              seq2seq_batch, shift_right, span_corruption, text_infilling, token_deletion)

SENTINELS = list(range(1000, 1100))


def _gen(seed: int = 0) -> torch.Generator:
    return torch.Generator().manual_seed(seed)


def _is_subsequence(small: list[int], big: list[int]) -> bool:
    it = iter(big)
    return all(any(x == y for y in it) for x in small)


def test_noise_mask_counts_and_spans():
    g = _gen()
    spans, noise_total, n_masks = [], 0, 0
    for length in (2, 3, 7, 20, 64, 101, 512):
        for _ in range(20):
            mask = random_spans_noise_mask(length, 0.15, 3.0, g)
            assert len(mask) == length and not mask[0]  # T5 starts with a gap
            n_noise = sum(mask)
            assert n_noise == min(max(round(length * 0.15), 1), length - 1)
            runs = [len(r) for r in "".join("x" if m else " " for m in mask).split()]
            assert len(runs) == min(max(round(n_noise / 3.0), 1), n_noise, length - n_noise)
            if length == 512:
                spans += runs
                noise_total += n_noise
                n_masks += 1
    assert abs(sum(spans) / len(spans) - 3.0) < 0.2  # mean span length 3
    assert abs(noise_total / (n_masks * 512) - 0.15) < 0.005


def test_span_corruption_round_trip():
    g = _gen(1)
    for length in (1, 2, 5, 30, 200):
        tokens = torch.randint(0, 900, (length,), generator=g).tolist()
        inputs, targets = span_corruption(tokens, SENTINELS, generator=g, eos_id=1)
        assert inputs[-1] == 1
        inputs = inputs[:-1]
        used = [t for t in inputs if t in SENTINELS]
        assert used == SENTINELS[:len(used)]  # sentinels in order, one per span
        assert [t for t in targets if t in SENTINELS] == used
        # filling each sentinel of the input with the span after it in the target gives the text back
        pieces, current = {}, None
        for t in targets:
            if t in SENTINELS:
                current = t
                pieces[current] = []
            else:
                pieces[current].append(t)
        rebuilt = [x for t in inputs for x in (pieces[t] if t in SENTINELS else [t])]
        assert rebuilt == tokens
        if length >= 30:
            assert len(targets) - len(used) == round(length * 0.15)


def test_text_infilling():
    g = _gen(2)
    mask_id = 5000
    for length in (0, 1, 10, 50, 300):
        tokens = torch.randint(0, 900, (length,), generator=g).tolist()
        out = text_infilling(tokens, mask_id, 0.3, 3.0, g)
        kept = [t for t in out if t != mask_id]
        assert _is_subsequence(kept, tokens)
        assert all(not (a == b == mask_id) for a, b in zip(out, out[1:]))  # one mask per masked run
        if length >= 50:
            assert len(tokens) - len(kept) == -(-length * 3 // 10)  # ceil(0.3 n) tokens hidden
            assert mask_id in out


def test_token_deletion_and_sentence_permutation():
    g = _gen(3)
    tokens = list(range(100, 140))
    out = token_deletion(tokens, 0.1, g)
    assert len(out) == 36 and _is_subsequence(out, tokens)
    text = [10, 11, 0, 12, 0, 13, 14, 15, 0, 16]  # 0 ends a sentence; the last one has no end
    sentences = [[10, 11, 0], [12, 0], [13, 14, 15, 0], [16]]
    seen = set()
    for seed in range(30):
        out = sentence_permutation(text, {0}, _gen(seed))
        assert sorted(out) == sorted(text)
        order = []
        i = 0
        while i < len(out):  # the output is the sentences, whole, in some order
            s = next(s for s in sentences if out[i:i + len(s)] == s)
            order.append(sentences.index(s))
            i += len(s)
        assert sorted(order) == [0, 1, 2, 3]
        seen.add(tuple(order))
    assert len(seen) > 5


def test_teacher_forcing_and_padding():
    labels = torch.tensor([[5, 6, 7, 1], [8, 1, IGNORE_INDEX, IGNORE_INDEX]])
    assert shift_right(labels, 0, 0).tolist() == [[0, 5, 6, 7], [0, 8, 1, 0]]
    batch = seq2seq_batch([[3, 4, 5], [6]], [[5, 6, 7], [8]], pad_id=0, eos_id=1)
    assert batch["input_ids"].tolist() == [[3, 4, 5], [6, 0, 0]]
    assert batch["attention_mask"].tolist() == [[1, 1, 1], [1, 0, 0]]
    assert batch["labels"].tolist() == labels.tolist()
    # padding changes neither the loss sum nor its count
    logits = torch.randn(2, 4, 20)
    padded_logits = torch.cat([logits, torch.randn(2, 3, 20)], dim=1)
    padded_labels = torch.cat([labels, torch.full((2, 3), IGNORE_INDEX)], dim=1)
    a, b = next_token_loss(logits, labels), next_token_loss(padded_logits, padded_labels)
    assert torch.allclose(a.sum, b.sum) and int(a.count) == int(b.count) == 6


def test_text_infilling_hides_exactly_the_budget_on_short_rows():
    # overlapping spans, spans cut by the end of the row and 0-length spans must not leave the budget short
    mask_id = 5000
    for seed in range(60):
        g = _gen(seed)
        for length in (1, 2, 3, 4, 5, 7, 10, 13, 20):
            tokens = list(range(10, 10 + length))
            out = text_infilling(tokens, mask_id, 0.3, 3.0, g)
            kept = [t for t in out if t != mask_id]
            assert _is_subsequence(kept, tokens)
            assert len(tokens) - len(kept) == -(-length * 3 // 10), (seed, length, out)
    assert text_infilling([1, 2, 3], mask_id, 1.5, 3.0, _gen()) == [mask_id]  # a ratio above 1 hides everything


def test_span_objective_numbers_sentinels_down_from_the_top_like_t5():
    import lmkit
    from lmkit.data.tokenize import vocab_size_of
    from lmkit.train.denoise import SENTINELS
    from lmkit.train.objectives import get_objective

    tok = lmkit.train_tokenizer(["def f(x): return x + 1. print(f(2))."] * 20, kind="bpe", vocab_size=300)
    before = vocab_size_of(tok)
    task = get_objective("span").prepare(tok)
    V = vocab_size_of(tok)
    assert V == before + len(SENTINELS)
    assert [tok.token_to_id(s) for s in SENTINELS] == list(range(V - 1, V - 1 - len(SENTINELS), -1))
    rows = torch.tensor([[0] + tok.encode("print(f(2)). def f(x): return x + 1.") * 3])
    batch = task.build_batch(rows, pad_id=-1, generator=_gen())
    first = [t for t in batch["input_ids"][0].tolist() if t >= before]
    assert first[0] == V - 1 and first == sorted(first, reverse=True)  # <extra_id_0> first, then descending
