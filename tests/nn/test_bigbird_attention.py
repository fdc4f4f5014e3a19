"""BigBird's block-sparse attention (`lmkit.nn.bigbird_attention`) against its definition written as a dense mask over
blocks in float64: global first and last query blocks, window and global key blocks, random blocks (duplicates
counted as often as they are listed, as transformers' eval mode lists block 0), padding; values and gradients."""
from __future__ import annotations

import pytest
import torch

from lmkit.nn.bigbird_attention import block_sparse_attention, random_blocks
from helpers.sparse_attention import bigbird_reference as dense_reference


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
