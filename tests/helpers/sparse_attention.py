"""The sparse attention patterns written densely in float64: the definitions the batched blocks and the block tiles
are checked against."""
import torch


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
