"""Masked-LM corruption (proportions, what is never chosen, dynamic and whole-word masking), its loss,
and next-sentence pairs."""
from __future__ import annotations

import math

import pytest
import torch

from lmkit.objectives import IGNORE_INDEX, mask_tokens, masked_lm_loss, next_sentence_loss, next_sentence_pairs

V, MASK, CLS, SEP, PAD = 5000, 4, 2, 3, 0


def rows(n=400, t=256, seed=0):
    g = torch.Generator().manual_seed(seed)
    ids = torch.randint(5, V, (n, t), generator=g)
    ids[:, 0], ids[:, -1] = CLS, SEP
    lengths = torch.randint(t // 2, t + 1, (n,), generator=g)
    mask = (torch.arange(t)[None] < lengths[:, None]).long()
    ids[mask == 0] = PAD
    return ids, mask


def within(observed, p, n, sigmas=5.0):
    return abs(observed - p) < sigmas * math.sqrt(p * (1 - p) / n)


def test_proportions_15_80_10_10():
    ids, mask = rows()
    g = torch.Generator().manual_seed(1)
    inputs, labels = mask_tokens(ids, MASK, V, special_ids=(CLS, SEP, PAD), attention_mask=mask, generator=g)
    eligible = (mask == 1) & (ids != CLS) & (ids != SEP)
    chosen = labels != IGNORE_INDEX
    n_elig, n_chosen = int(eligible.sum()), int(chosen.sum())
    assert within(n_chosen / n_elig, 0.15, n_elig)
    masked = chosen & (inputs == MASK)
    kept = chosen & (inputs == ids)
    random = chosen & (inputs != MASK) & (inputs != ids)
    # a random draw equals the original (or [MASK]) with probability ~1/V: folded into the expectations
    assert within(int(masked.sum()) / n_chosen, 0.8 + 0.1 / V, n_chosen)
    assert within(int(kept.sum()) / n_chosen, 0.1 + 0.1 / V, n_chosen)
    assert within(int(random.sum()) / n_chosen, 0.1 - 0.2 / V, n_chosen)
    assert torch.equal(labels[chosen], ids[chosen])
    assert torch.equal(inputs[~chosen], ids[~chosen])  # nothing outside the chosen positions changes


def test_special_tokens_and_padding_never_chosen():
    ids, mask = rows(n=100)
    for seed in range(5):
        inputs, labels = mask_tokens(ids, MASK, V, special_ids=(CLS, SEP, PAD), attention_mask=mask,
                                     mlm_probability=0.9, generator=torch.Generator().manual_seed(seed))
        never = (mask == 0) | (ids == CLS) | (ids == SEP)
        assert (labels[never] == IGNORE_INDEX).all()
        assert torch.equal(inputs[never], ids[never])


def test_dynamic_masking_differs_per_batch_and_repeats_per_seed():
    ids, mask = rows(n=8)
    a = mask_tokens(ids, MASK, V, (CLS, SEP, PAD), mask, generator=torch.Generator().manual_seed(1))
    b = mask_tokens(ids, MASK, V, (CLS, SEP, PAD), mask, generator=torch.Generator().manual_seed(2))
    c = mask_tokens(ids, MASK, V, (CLS, SEP, PAD), mask, generator=torch.Generator().manual_seed(1))
    assert not torch.equal(a[1], b[1])
    assert torch.equal(a[0], c[0]) and torch.equal(a[1], c[1])


def test_whole_word_masking_chooses_words_as_units():
    ids, mask = rows(n=300, t=128, seed=3)
    g = torch.Generator().manual_seed(4)
    starts = torch.rand(ids.shape, generator=g) < 0.4  # a word is 2.5 tokens on average
    starts[:, 0] = starts[:, 1] = True
    starts |= (ids == SEP) | (mask == 0)
    _, labels = mask_tokens(ids, MASK, V, (CLS, SEP, PAD), mask, word_starts=starts, generator=g)
    chosen = labels != IGNORE_INDEX
    word = torch.cumsum(starts.long(), dim=1)
    n_words = chosen_words = 0
    for r in range(ids.shape[0]):
        real = (mask[r] == 1) & (ids[r] != CLS) & (ids[r] != SEP)
        for w in torch.unique(word[r][real]).tolist():
            members = chosen[r][(word[r] == w) & real]
            assert members.all() or not members.any()  # all tokens of a word or none
            n_words += 1
            chosen_words += bool(members.all())
    assert within(chosen_words / n_words, 0.15, n_words)


def test_loss_is_mean_over_chosen_positions_only():
    g = torch.Generator().manual_seed(0)
    logits = torch.randn(3, 7, 11, generator=g)
    labels = torch.full((3, 7), IGNORE_INDEX)
    labels[0, 2], labels[1, 5], labels[2, 0] = 4, 9, 1
    ls = masked_lm_loss(logits, labels)
    manual = -(torch.log_softmax(logits[0, 2], -1)[4] + torch.log_softmax(logits[1, 5], -1)[9]
               + torch.log_softmax(logits[2, 0], -1)[1]) / 3
    assert int(ls.count) == 3
    torch.testing.assert_close(ls.mean, manual)
    other = logits.clone()
    keep = labels != IGNORE_INDEX
    other[~keep] = torch.randn_like(other[~keep]) * 100  # every other position may hold anything
    torch.testing.assert_close(masked_lm_loss(other, labels).mean, ls.mean)


def test_encoder_mlm_loss_matches_objective():
    from lmkit.config import get_preset
    from lmkit.models.encoder import Encoder

    cfg = get_preset("bert", vocab_size=40, d_model=16, n_layers=1, n_heads=2, d_ff=24, max_seq_len=16, dropout=0.0)
    model = Encoder(cfg)
    ids = torch.randint(5, 40, (4, 12))
    inputs, labels = mask_tokens(ids, MASK, 40, (CLS, SEP, PAD), generator=torch.Generator().manual_seed(0),
                                 mlm_probability=0.3)
    out = model(inputs, labels=labels)
    torch.testing.assert_close(out.loss, masked_lm_loss(out.logits, labels).mean)


def test_next_sentence_pairs_half_random():
    docs = [[[10 + d, 100 + i] for i in range(30)] for d in range(20)]
    examples = next_sentence_pairs(docs, CLS, SEP, max_len=16, generator=torch.Generator().manual_seed(0))
    labels = [label for _, _, label in examples]
    assert len(examples) == 20 * 29
    assert within(sum(labels) / len(labels), 0.5, len(labels))
    for ids, types, label in examples:
        assert ids[0] == CLS and ids[3] == SEP and ids[-1] == SEP and len(ids) == len(types)
        assert types == [0, 0, 0, 0, 1, 1, 1]
        a, b = ids[1:3], ids[4:6]
        if label == 0:
            assert b[0] == a[0] and b[1] == a[1] + 1  # the true successor
        else:
            assert b[0] != a[0]  # another document
    long = [[list(range(20, 60)), list(range(60, 90))], [[7, 8]]]
    ids, types, _ = next_sentence_pairs(long, CLS, SEP, max_len=16, random_fraction=0.0)[0]
    assert len(ids) == 16 and ids.count(SEP) == 2 and len(types) == 16


def test_next_sentence_loss_counts_pairs():
    logits = torch.tensor([[2.0, 0.0], [0.0, 1.0]])
    ls = next_sentence_loss(logits, torch.tensor([0, 1]))
    assert int(ls.count) == 2
    torch.testing.assert_close(ls.mean, torch.nn.functional.cross_entropy(logits, torch.tensor([0, 1])))


def test_mask_tokens_rejects_impossible_probabilities():
    ids, mask = rows(n=2, t=8)
    for bad in (dict(mlm_probability=1.5), dict(mlm_probability=-0.1), dict(mask_fraction=0.9, random_fraction=0.2),
                dict(random_fraction=-0.1)):
        with pytest.raises(ValueError):
            mask_tokens(ids, MASK, V, (CLS, SEP, PAD), mask, **bad)
    # the edges are allowed: nothing chosen, or every eligible position chosen and all of them [MASK]
    _, labels = mask_tokens(ids, MASK, V, (CLS, SEP, PAD), mask, mlm_probability=0.0)
    assert (labels == IGNORE_INDEX).all()
    inputs, labels = mask_tokens(ids, MASK, V, (CLS, SEP, PAD), mask, mlm_probability=1.0, mask_fraction=1.0,
                                 random_fraction=0.0)
    eligible = (mask == 1) & (ids != CLS) & (ids != SEP)
    assert (labels != IGNORE_INDEX).eq(eligible).all() and (inputs[eligible] == MASK).all()
