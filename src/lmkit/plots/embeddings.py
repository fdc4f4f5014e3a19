"""A 2-D PCA of token or word vectors with labels: X centered, projected on its top two right singular vectors."""
from __future__ import annotations

from pathlib import Path
from typing import Sequence

import numpy as np

from lmkit.plots import new_figure, save


def pca_2d(vectors: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
    """(coordinates (N, 2), share of the variance on each axis): (X - mean) V_2 from the SVD X - mean = U S V^T,
    each axis's sign fixed so that its largest loading is positive."""
    x = np.asarray(vectors, dtype=np.float64)
    x = x - x.mean(0)
    _, s, vt = np.linalg.svd(x, full_matrices=False)
    axes = vt[:2]
    axes = axes * np.sign(axes[np.arange(len(axes)), np.abs(axes).argmax(1)])[:, None]
    share = (s[:2] ** 2) / max((s ** 2).sum(), 1e-300)
    return x @ axes.T, share


def plot_embeddings(labels: Sequence[str], vectors: np.ndarray, out: str | Path, title: str = "") -> Path:
    coords, share = pca_2d(vectors)
    fig = new_figure(9, 8)
    ax = fig.add_subplot(1, 1, 1)
    ax.scatter(coords[:, 0], coords[:, 1], s=8, alpha=0.6)
    for (x, y), label in zip(coords, labels):
        ax.annotate(label, (x, y), fontsize=7, alpha=0.8)
    ax.set_xlabel(f"PC 1 ({share[0]:.1%} of the variance)")
    ax.set_ylabel(f"PC 2 ({share[1]:.1%} of the variance)")
    ax.set_title(title or f"PCA of {len(labels)} vectors")
    return save(fig, out, {"labels": list(labels), "coords": coords.tolist(), "variance_share": share.tolist()})
