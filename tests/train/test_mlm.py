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


def test_whole_word_rows_may_open_inside_a_word_and_words_stop_at_special_tokens():
    # columns 0-1 continue a word cut off before the row, 2-4 are a word, 5 is [SEP], 6-8 continue after it
    # without a start of their own: the three are separate words, drawn independently
    n = 20000
    ids = torch.randint(5, V, (n, 9), generator=torch.Generator().manual_seed(5))
    ids[:, 5] = SEP
    starts = torch.zeros(ids.shape, dtype=torch.bool)
    starts[:, 2] = True
    _, labels = mask_tokens(ids, MASK, V, (CLS, SEP, PAD), word_starts=starts, generator=torch.Generator().manual_seed(6))
    chosen = labels != IGNORE_INDEX
    for a, b in ((0, 1), (2, 4), (6, 8)):
        assert torch.equal(chosen[:, a], chosen[:, b])  # one word, one draw
    for a, b in ((0, 2), (2, 6)):
        both = int((chosen[:, a] & chosen[:, b]).sum()) / n
        assert within(both, 0.15 ** 2, n)  # independent words, not one


def test_whole_word_masking_keeps_80_10_10_per_token():
    ids, mask = rows(n=400, t=128, seed=7)
    starts = torch.rand(ids.shape, generator=torch.Generator().manual_seed(8)) < 0.4
    inputs, labels = mask_tokens(ids, MASK, V, (CLS, SEP, PAD), mask, word_starts=starts,
                                 generator=torch.Generator().manual_seed(9))
    chosen = labels != IGNORE_INDEX
    eligible = (mask == 1) & (ids != CLS) & (ids != SEP)
    n_elig, n_chosen = int(eligible.sum()), int(chosen.sum())
    assert not (chosen & ~eligible).any()
    assert abs(n_chosen / n_elig - 0.15) < 0.01  # 15% of the eligible tokens (words of ~2.5 tokens: wider spread)
    assert within(int((chosen & (inputs == MASK)).sum()) / n_chosen, 0.8, n_chosen)
    assert within(int((chosen & (inputs == ids)).sum()) / n_chosen, 0.1, n_chosen)


WORDS = ("parameter tokenizer embedding attention gradient optimizer transformer encoder decoder vocabulary "
         "sequence position softmax layer norm residual").split()


@pytest.mark.parametrize("kind,vocab_size", [("wordpiece", 120), ("bpe", 300), ("unigram", 45)])
def test_word_starts_from_tokenizer_pieces_mask_text_words_whole(kind, vocab_size):
    import random

    from lmkit import train_tokenizer
    from lmkit.objectives import word_starts
    from lmkit.tokenizers.words import word_boundaries
    from lmkit.train.masked import MaskedLM

    rng = random.Random(0)
    texts = [" ".join(rng.choice(WORDS) for _ in range(12)) + ("\n" if i % 3 else "  ") + rng.choice(WORDS)
             for i in range(300)]
    tok = train_tokenizer(texts, kind=kind, vocab_size=vocab_size, special_tokens=["[PAD]", "[MASK]"])
    begins, ends = (torch.tensor(x) for x in word_boundaries(tok))
    pad, mask_id = tok.token_to_id("[PAD]"), tok.token_to_id("[MASK]")
    encoded = [tok.encode(t, add_special_tokens=False) for t in texts]
    width = max(map(len, encoded))
    ids = torch.full((len(texts), width), pad)
    for r, e in enumerate(encoded):
        ids[r, :len(e)] = torch.tensor(e)
    starts = word_starts(ids, begins, ends)
    for r, e in enumerate(encoded):  # the pieces between starts spell the text's whitespace-separated words
        cuts = [c for c in range(len(e)) if starts[r, c]] + [len(e)]
        words = [tok.decode(e[a:b]).strip() for a, b in zip(cuts, cuts[1:])]
        assert [w for w in words if w] == texts[r].split()
    task = MaskedLM(mask_id, tok.vocab_size, (mask_id,), words=(begins, ends))
    batch = task.build_batch(torch.cat([ids, ids[:, :1]], 1), pad, torch.Generator().manual_seed(0))
    chosen = batch["labels"] != IGNORE_INDEX
    word = torch.cumsum(starts.long(), dim=1)
    multi = 0
    for r in range(len(texts)):
        for w in torch.unique(word[r][ids[r] != pad]).tolist():
            members = chosen[r][(word[r] == w) & (ids[r] != pad)]
            assert members.all() or not members.any()
            multi += len(members) > 1 and bool(members.all())
    assert multi > 0 and not chosen[ids == pad].any()


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
