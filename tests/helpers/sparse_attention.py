"""The sparse attention patterns written densely in float64: the definitions the batched blocks and the block tiles
are checked against."""
import torch


def longformer_case(T: int, w: int):
    """float64 q, k, v (3 rows, 2 heads, width 5; gradients on) and their `token_mask`: row 1 padded past its middle,
    row 2 in its last two tokens, global tokens first and last (row 0), in the middle (row 1) and on padding (row 2:
    a padding token marked global stays padding)."""
    from lmkit.nn.sparse_attention import token_mask

    g = torch.Generator().manual_seed(T * 10 + w)
    B, H, D = 3, 2, 5
    q, k, v = (torch.randn(B, H, T, D, generator=g, dtype=torch.float64, requires_grad=True) for _ in range(3))
    mask = torch.ones(B, T, dtype=torch.long)
    mask[1, T // 2 + 1:] = 0
    mask[2, max(T - 2, 1):] = 0
    glob = torch.zeros(B, T, dtype=torch.long)
    glob[0, [0, T - 1]] = 1
    glob[1, T // 2] = 1
    glob[2, -1] = 1
    return q, k, v, token_mask(mask, glob, B, T, q.device), g


def longformer_reference(q, k, v, keep, glob, w):
    """softmax over {j : |i - j| <= w, keep_j, not glob_j} and {j : glob_j}, zeros at padding queries."""
    T = q.shape[2]
    i = torch.arange(T)
    allowed = ((i[:, None] - i[None]).abs() <= w) & (keep & ~glob)[:, None, None, :] | glob[:, None, None, :]
    scores = (q @ k.transpose(-1, -2)).masked_fill(~allowed, float("-inf"))
    out = torch.softmax(scores, -1) @ v
    return out.masked_fill(~keep[:, None, :, None], 0.0)


def bigbird_reference(q, k, v, keep, b, rand):
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
