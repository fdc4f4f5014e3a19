"""Packing, the deterministic sampler, and evaluation rows that score every token once."""
import numpy as np
import torch

from lmkit.data.stream import PackedStream, TokenizedCorpus, eval_rows

BOS, PAD = 1, 0


def corpus_of(lengths, seed=0):
    rng = np.random.default_rng(seed)
    docs = [rng.integers(2, 100, n).astype(np.int32) for n in lengths]
    offsets = np.concatenate([[0], np.cumsum(lengths)]).astype(np.int64)
    return TokenizedCorpus(np.concatenate(docs), offsets, np.array([3 * n for n in lengths], dtype=np.int64)), docs


def test_rows_begin_with_bos_and_are_windows_of_the_packed_stream():
    tc, docs = corpus_of([5, 30, 2, 17, 9])
    stream = PackedStream(tc, BOS, seq_len=8)
    # stream = BOS piece BOS piece ..., documents cut into pieces of at most 8 tokens
    expected = []
    for d in docs:
        for s in range(0, len(d), 8):
            expected += [BOS] + d[s:s + 8].tolist()
    assert stream.stream.tolist() == expected
    rows = stream.global_rows(seed=3, step=0, batch_size=64)
    assert rows.shape == (64, 9) and (rows[:, 0] == BOS).all()
    flat = stream.stream.tolist() * 2  # rows read the stream circularly
    for r in rows.tolist():
        starts = [i for i in range(len(expected)) if flat[i:i + 9] == r]
        assert starts and expected[starts[0]] == BOS


def test_batches_are_a_function_of_seed_and_step_only():
    tc, _ = corpus_of([50] * 20)
    a, b = PackedStream(tc, BOS, 16), PackedStream(tc, BOS, 16)
    assert torch.equal(a.global_rows(0, 5, 8), b.global_rows(0, 5, 8))
    b.global_rows(0, 99, 8)  # drawing other steps first changes nothing
    assert torch.equal(a.global_rows(0, 6, 8), b.global_rows(0, 6, 8))
    assert not torch.equal(a.global_rows(0, 5, 8), a.global_rows(0, 6, 8))
    assert not torch.equal(a.global_rows(0, 5, 8), a.global_rows(1, 5, 8))


def test_ranks_split_the_global_batch():
    tc, _ = corpus_of([40] * 10)
    s = PackedStream(tc, BOS, 8)
    whole = s.global_rows(7, 2, 12)
    parts = [s.rows(7, 2, 12, rank=r, world_size=3) for r in range(3)]
    assert torch.equal(torch.cat(parts), whole)


def test_eval_rows_score_every_token_exactly_once():
    tc, docs = corpus_of([5, 30, 2, 17])
    rows, mask, nbytes = eval_rows(tc, BOS, PAD, seq_len=8)
    assert nbytes == 3 * (5 + 30 + 2 + 17)
    assert (rows[:, 0] == BOS).all() and rows.shape[1] == 9
    assert int(mask[:, 1:].sum()) == tc.num_tokens
    scored = [t for r, m in zip(rows.tolist(), mask.tolist()) for t, k in zip(r[1:], m[1:]) if k]
    assert scored == np.concatenate(docs).tolist()
    assert (rows[mask == 0] == PAD).all()
    _, mask2, nbytes2 = eval_rows(tc, BOS, PAD, seq_len=8, max_docs=2)
    assert int(mask2[:, 1:].sum()) == 35 and nbytes2 == 3 * 35


def test_a_row_longer_than_the_training_split_is_refused():
    import pytest

    from lmkit.errors import CorpusError

    tc, _ = corpus_of([5, 6])  # stream: BOS + 5, BOS + 6 = 13 tokens
    PackedStream(tc, BOS, 12)  # a row of 13 still fits
    with pytest.raises(CorpusError, match="fewer than one row of 14; give more text or lower --seq-len"):
        PackedStream(tc, BOS, 13)
