"""One vectorized SGD step of word2vec over a batch, for skip-gram and CBOW, compiled when possible.

For hidden vector h (the input vector v_c in skip-gram, the window mean in CBOW) and output rows u:
negative sampling: g_j = lr (label_j - s(u_j.h)), label 1 for the target, 0 for each noise draw (a draw
equal to the target gets g = 0); hierarchical softmax: g_n = lr (1 - code_n - s(u_n.h)) over the path,
nodes with |u_n.h| >= MAX_EXP skipped. Then u_j += g_j h and the input side gets sum_j g_j u_j (old u).
All reads come before all writes within the batch; a row hit several times gets the sum of its updates.
Compiled by inductor the gathers, products and scatter-adds fuse into a few loops (about 3x faster on CPU
than the same eager ops); LMKIT_COMPILE_KERNELS=0, or no working compiler, runs them eagerly.
"""
from __future__ import annotations

import logging
import os

import torch

MAX_EXP = 6.0
_log = logging.getLogger(__name__)


def rows_of(matrix: torch.Tensor, index: torch.Tensor) -> torch.Tensor:
    """matrix[index] for a (B, n) index as (B, n, d); a flat index_select is several times faster on CPU
    than advanced indexing with a 2-D index."""
    return matrix.index_select(0, index.reshape(-1)).view(*index.shape, matrix.shape[1])


def output_gradient(h: torch.Tensor, lr: torch.Tensor, neg: torch.Tensor | None, rows: torch.Tensor | None,
                    hs: torch.Tensor | None, points: torch.Tensor | None, codes: torch.Tensor | None,
                    path_mask: torch.Tensor | None, target: torch.Tensor) -> torch.Tensor:
    """Update the output matrices (neg: rows (B, 1 + k), target first; hs: the target's Huffman path) for
    predicting `target` from h (B, d) and return the step for h."""
    B, d = h.shape
    step = torch.zeros_like(h)
    if neg is not None:
        u = rows_of(neg, rows)  # (B, 1 + k, d)
        f = torch.sigmoid((u * h[:, None, :]).sum(-1))
        label = torch.zeros_like(f)
        label[:, 0] = 1.0
        g = (label - f) * lr
        own = torch.cat((torch.zeros_like(rows[:, :1], dtype=torch.bool), rows[:, 1:] == rows[:, :1]), dim=1)
        g = g.masked_fill(own, 0.0)
        step = step + torch.bmm(g[:, None, :], u)[:, 0]
        neg.index_add_(0, rows.reshape(-1), (g[:, :, None] * h[:, None, :]).reshape(-1, d))
    if hs is not None:
        nodes, code, mask = points[target], codes[target], path_mask[target]
        u = rows_of(hs, nodes)
        score = (u * h[:, None, :]).sum(-1)
        keep = mask & (score.abs() < MAX_EXP)
        g = ((1.0 - code - torch.sigmoid(score)) * lr).masked_fill(~keep, 0.0)
        step = step + torch.bmm(g[:, None, :], u)[:, 0]
        hs.index_add_(0, nodes.reshape(-1), (g[:, :, None] * h[:, None, :]).reshape(-1, d))
    return step


def skipgram_step(W, inputs, target, lr, neg, rows, hs, points, codes, path_mask) -> None:
    """Skip-gram: h = W[inputs] (the context words), predicting `target` (the center words)."""
    h = W.index_select(0, inputs)
    W.index_add_(0, inputs, output_gradient(h, lr, neg, rows, hs, points, codes, path_mask, target))


def cbow_step(W, context, context_mask, target, lr, neg, rows, hs, points, codes, path_mask) -> None:
    """CBOW: h = mean of W over each window's context words (B, 2 window; mask marks the real ones); every
    context word gets the whole step for h (gensim's cbow_mean=1)."""
    m = context_mask.to(W.dtype)
    h = torch.bmm(m[:, None, :], rows_of(W, context))[:, 0] / m.sum(1).clamp(min=1.0)[:, None]
    step = output_gradient(h, lr, neg, rows, hs, points, codes, path_mask, target)
    W.index_add_(0, context.reshape(-1), (step[:, None, :] * m[:, :, None]).reshape(-1, W.shape[1]))


class Steps:
    """skipgram_step and cbow_step, compiled for one batch shape; other shapes (a chunk's last batch) and
    machines without a compiler run the eager functions, which compute the same."""

    def __init__(self, compile: bool = True):
        self.compiled: dict[str, object] = {}
        self.enabled = compile and os.environ.get("LMKIT_COMPILE_KERNELS", "1") != "0"
        self.batch: dict[str, int] = {}

    def warm(self, name: str, *args) -> None:
        """Compile `name` on these arguments with lr = 0 (the updates add zeros), so that worker threads only
        ever call a finished kernel."""
        if not self.enabled:
            return
        fn = skipgram_step if name == "skipgram" else cbow_step
        try:
            compiled = torch.compile(fn, dynamic=False, fullgraph=True)
            lr_at = 3 if name == "skipgram" else 4
            zero = [torch.zeros(()) if i == lr_at else a for i, a in enumerate(args)]
            compiled(*zero)
            self.compiled[name] = compiled
            self.batch[name] = args[1].shape[0]
        except Exception as err:  # no C++ compiler, or inductor unavailable: eager it is
            _log.info("compiled word2vec step unavailable (%s); running eagerly", err)
            self.enabled = False

    def __call__(self, name: str, *args) -> None:
        eager = skipgram_step if name == "skipgram" else cbow_step
        fn = self.compiled.get(name)
        if fn is None or args[1].shape[0] != self.batch[name]:
            return eager(*args)
        try:
            fn(*args)
        except RuntimeError as err:  # dynamo refused the call in this thread before running it: nothing was updated
            if "no compiled frames" not in str(err):
                raise
            _log.info("compiled word2vec step refused here (%s); running eagerly", err)
            self.compiled.pop(name, None)
            eager(*args)
