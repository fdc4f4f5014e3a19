"""BigBird's block-sparse attention (`lmkit.nn.bigbird_attention`) against its definition written as a dense mask over
blocks in float64: global first and last query blocks, window and global key blocks, random blocks (duplicates
counted as often as they are listed, as transformers' eval mode lists block 0), padding; values and gradients."""
from __future__ import annotations

import pytest
import torch

from lmkit.nn.bigbird_attention import block_sparse_attention, random_blocks


def dense_reference(q, k, v, keep, b, rand):
    """Each query block's key blocks as a list with multiplicity, softmax over the listed keys."""
    B, H, T, D = q.shape
    n = T // b
    out = torch.zeros_like(q)
    for h in range(H):
        for i in range(n):
            if i in (0, n - 1):
                blocks = list(range(n))
            else:
                blocks = sorted({0, i - 1, i, i + 1, n - 1}) + rand[h, i - 1].tolist()
            cols = torch.cat([torch.arange(j * b, (j + 1) * b) for j in blocks])
            scores = q[:, h, i * b:(i + 1) * b] @ k[:, h, cols].transpose(-1, -2)
            scores = scores.masked_fill(~keep[:, None, cols], float("-inf"))
            out[:, h, i * b:(i + 1) * b] = torch.softmax(scores, -1) @ v[:, h, cols]
    return out.masked_fill(~keep[:, None, :, None], 0.0)


@pytest.mark.parametrize("n,b,r,eval_mode", [(9, 3, 2, False), (12, 2, 3, False), (9, 4, 2, True)])
def test_block_sparse_attention_equals_its_dense_definition(n, b, r, eval_mode):
    g = torch.Generator().manual_seed(n * b + r)
    B, H, D = 2, 3, 4
    T = n * b
    q, k, v = (torch.randn(B, H, T, D, generator=g, dtype=torch.float64, requires_grad=True) for _ in range(3))
    keep = torch.ones(B, T, dtype=torch.bool)
    keep[1, T - b - 2:] = False   # padding reaching into the last two blocks
    rand = torch.zeros(H, n - 2, r, dtype=torch.long) if eval_mode else random_blocks(n, r, H, seed=3)
    got = block_sparse_attention(q, k, v, keep, b, rand)
    want = dense_reference(q, k, v, keep, b, rand)
    torch.testing.assert_close(got, want, atol=1e-12, rtol=0)
    weights = torch.randn(got.shape, generator=g, dtype=torch.float64)
    for a, e in zip(torch.autograd.grad((got * weights).sum(), (q, k, v)),
                    torch.autograd.grad((want * weights).sum(), (q, k, v))):
        torch.testing.assert_close(a, e, atol=1e-12, rtol=0)
