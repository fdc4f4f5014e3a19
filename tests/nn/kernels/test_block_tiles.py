"""Sparse attention through block tiles (`lmkit.nn.kernels.block_tiles`): Longformer's window + global tokens and
BigBird's blocks equal their float64 definitions, values and gradients; what a training step keeps for backward
grows linearly with the length and stays below the batched blocks'; a model trains through them with the batched
path's gradients."""
from __future__ import annotations

import pytest
import torch

from helpers.sparse_attention import bigbird_reference, longformer_case, longformer_reference
from lmkit.nn import sparse_attention
from lmkit.nn.bigbird_attention import block_sparse_attention, block_sparse_tiles, random_blocks
from lmkit.nn.sparse_attention import sliding_global_attention, sliding_global_tiles, token_mask


def _values_and_grads(f, q, k, v, g):
    out = f(q, k, v)
    weights = torch.randn(out.shape, generator=g, dtype=out.dtype)
    return (out, *torch.autograd.grad((out * weights).sum(), (q, k, v)))


@pytest.mark.parametrize("T,w", [(23, 2), (5, 8), (1, 3), (37, 5), (300, 3)])
def test_longformer_tiles_equal_the_dense_formula(T, w):
    """Odd lengths (no padding to the window multiple), windows wider than the row, several tiles (300 tokens, w 3:
    tiles of 126), padded rows and global tokens first, in the middle, last and on padding."""
    q, k, v, m, _ = longformer_case(T, w)
    got = _values_and_grads(lambda *a: sliding_global_tiles(*a, m, w), q, k, v, torch.Generator().manual_seed(1))
    want = _values_and_grads(lambda *a: longformer_reference(*a, m.keep, m.glob, w), q, k, v,
                             torch.Generator().manual_seed(1))
    for a, b in zip(got, want):
        torch.testing.assert_close(a, b, atol=1e-12, rtol=0)


@pytest.mark.parametrize("n,b,r,eval_mode", [(9, 3, 2, False), (12, 2, 3, False), (9, 4, 2, True), (7, 3, 0, False)])
def test_bigbird_tiles_equal_the_dense_definition(n, b, r, eval_mode):
    """Random blocks drawn or all block 0 (eval: listed again beside the global block, counted each time), none,
    padding reaching into the last two blocks."""
    g = torch.Generator().manual_seed(n * b + r)
    B, H, D = 2, 3, 4
    T = n * b
    q, k, v = (torch.randn(B, H, T, D, generator=g, dtype=torch.float64, requires_grad=True) for _ in range(3))
    keep = torch.ones(B, T, dtype=torch.bool)
    keep[1, T - b - 2:] = False
    rand = torch.zeros(H, n - 2, r, dtype=torch.long) if eval_mode else random_blocks(n, r, H, seed=3)
    got = _values_and_grads(lambda *a: block_sparse_tiles(*a, keep, b, rand), q, k, v, torch.Generator().manual_seed(1))
    want = _values_and_grads(lambda *a: bigbird_reference(*a, keep, b, rand), q, k, v, torch.Generator().manual_seed(1))
    for a, e in zip(got, want):
        torch.testing.assert_close(a, e, atol=1e-12, rtol=0)


def _saved_bytes(f, T: int) -> int:
    """Bytes autograd keeps for the backward of f on one row of T tokens (2 heads of 16)."""
    q, k, v = (torch.randn(1, 2, T, 16, requires_grad=True) for _ in range(3))
    saved = 0

    def pack(t):
        nonlocal saved
        saved += t.numel() * t.element_size()
        return t

    with torch.autograd.graph.saved_tensors_hooks(pack, lambda t: t):
        f(q, k, v, T)
    return saved


@pytest.mark.parametrize("pattern", ["longformer", "bigbird"])
def test_what_the_tiles_keep_for_backward_grows_linearly(pattern):
    """Doubling the length doubles the saved bytes (q, k, v, the output and its log-sum-exp: 4 T D + T numbers a
    head, and which rows are padding), and the batched blocks keep more (their probabilities: T (3w + G) or T (5 + r) b a head)."""
    glob = torch.zeros(1, 4096, dtype=torch.long)
    glob[0, [0, 1000]] = 1

    def mask(T):
        return token_mask(None, glob[:, :T], 1, T, torch.device("cpu"))

    if pattern == "longformer":
        tiles = lambda q, k, v, T: sliding_global_tiles(q, k, v, mask(T), 32)  # noqa: E731
        batched = lambda q, k, v, T: sliding_global_attention(q, k, v, mask(T), 32)  # noqa: E731
    else:
        keep = torch.ones(1, 4096, dtype=torch.bool)
        tiles = lambda q, k, v, T: block_sparse_tiles(q, k, v, keep[:, :T], 32, random_blocks(T // 32, 3, 2, 0))  # noqa: E731
        batched = lambda q, k, v, T: block_sparse_attention(q, k, v, keep[:, :T], 32, random_blocks(T // 32, 3, 2, 0))  # noqa: E731
    small, large = _saved_bytes(tiles, 2048), _saved_bytes(tiles, 4096)
    assert large == 2 * small
    assert small == 2 * (4 * 2048 * 16 + 2048) * 4 + 2048  # 2 heads in float32, and the padding rows (bool)
    assert _saved_bytes(batched, 4096) > 3 * large


@pytest.mark.parametrize("family", ["longformer", "bigbird"])
def test_a_sparse_model_trains_through_the_tiles_with_the_batched_path_gradients(family, monkeypatch):
    """Without dropout a training step runs the tiles; its loss and gradients equal the batched blocks' (the path
    inference takes), with padding (and Longformer's global tokens; BigBird's random blocks drawn)."""
    from lmkit.config import get_preset
    from lmkit.models import build_model
    from lmkit.nn import bigbird_attention

    module, tiled = ((sparse_attention, "sliding_global_tiles") if family == "longformer"
                     else (bigbird_attention, "block_sparse_tiles"))
    sparse = ({"sparse_attention": "longformer", "attention_window": [8, 4]} if family == "longformer" else
              {"sparse_attention": "bigbird", "block_size": 4, "num_random_blocks": 2})
    torch.manual_seed(0)
    config = get_preset("longformer-tiny", vocab_size=90, max_seq_len=80, dropout=0.0, attention_dropout=0.0,
                        sparse=sparse)
    model = build_model(config).train()
    ids = torch.randint(3, 90, (2, 57))
    mask = torch.ones_like(ids)
    mask[1, 50:] = 0
    extra = {}
    if family == "longformer":
        extra["global_attention_mask"] = torch.zeros_like(ids)
        extra["global_attention_mask"][:, [0, 20]] = 1
    ran = []
    real = getattr(module, tiled)
    monkeypatch.setattr(module, tiled, lambda *a: ran.append(1) or real(*a))

    def step():
        model.zero_grad()
        loss = model(ids, attention_mask=mask, **extra).logits.pow(2).mean()
        loss.backward()
        return loss.detach(), [p.grad.clone() for p in model.parameters() if p.grad is not None]

    loss, grads = step()
    assert ran, "the training step did not run the tiles"
    monkeypatch.setattr(module, "use_tiles", lambda dropout: False)
    ran.clear()
    want_loss, want_grads = step()
    assert not ran and len(grads) == len(want_grads)
    torch.testing.assert_close(loss, want_loss, atol=1e-6, rtol=1e-5)
    for a, b in zip(grads, want_grads):
        torch.testing.assert_close(a, b, atol=1e-5, rtol=1e-4)
