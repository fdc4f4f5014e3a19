"""A 2-D PCA of token or word vectors with labels: X centered, projected on its top two right singular vectors.

Which tokens to show by default: the whole words a model's text uses most (a word-start piece made of
letters, followed by a space, punctuation or the end rather than more letters), else its word pieces in id
order (BPE gives ids in merge order, and the earliest merges join the most frequent pairs). Labels are placed
in that order and one that would overlap a placed one is tried at three other corners, then left out.
"""
from __future__ import annotations

import re
import textwrap
from pathlib import Path
from typing import Iterable, Sequence

import numpy as np

from lmkit.plots import new_figure, save, token_label

LETTERS = re.compile(r"[^\W\d_]{2,}")  # two or more letters, nothing else


def word_pieces(tokenizer) -> dict[int, str]:
    """{id: word} of the vocabulary's tokens that start a word and are letters only (" the" -> "the"); where
    the vocabulary marks word starts by a leading space (byte-level BPE), only those pieces count."""
    special = set(getattr(tokenizer, "all_special_ids", None) or [])
    pieces = {i: tokenizer.decode([i]) for i in range(tokenizer.vocab_size) if i not in special}
    spaced = sum(p.startswith(" ") for p in pieces.values()) > 0.05 * max(len(pieces), 1)
    return {i: p.strip() for i, p in pieces.items()
            if LETTERS.fullmatch(p.strip()) and (p.startswith(" ") or not spaced)}


def frequent_words(tokenizer, texts: Iterable[str], count: int) -> list[int]:
    """The `count` ids seen most often in `texts` as a whole word, most frequent first (ties by id): a word
    piece followed by the end or by a token that does not go on the word (one starting with neither a letter,
    a digit nor WordPiece's "##")."""
    words, continues, seen = word_pieces(tokenizer), {}, {}
    for text in texts:
        ids = tokenizer.encode(text, add_special_tokens=False)
        for a, b in zip(ids, ids[1:] + [None]):
            if a not in words:
                continue
            if b is not None and b not in continues:
                piece = tokenizer.decode([b])  # WordPiece marks a piece inside a word by "##"
                continues[b] = bool(piece) and (piece[0].isalnum() or piece.startswith("##"))
            if b is None or not continues[b]:
                seen[a] = seen.get(a, 0) + 1
    return [i for i, _ in sorted(seen.items(), key=lambda kv: (-kv[1], kv[0]))[:count]]


def first_words(tokenizer, count: int) -> list[int]:
    """The `count` word pieces of lowest id: for BPE the earliest merges, the most frequent in its training text."""
    return sorted(word_pieces(tokenizer))[:count]


def place_labels(fig, ax, coords: np.ndarray, labels: Sequence[str], fontsize: float = 7) -> list[tuple]:
    """Annotate points in order, each at the first of four corners where its box overlaps no placed label
    (nor leaves the axes), else not at all; returns [(index, (x0, y0, x1, y1) in pixels)] of those placed."""
    from matplotlib.backends.backend_agg import FigureCanvasAgg

    renderer = FigureCanvasAgg(fig).get_renderer()
    frame = ax.get_window_extent(renderer)
    corners = (((3, 2), "left", "bottom"), ((3, -2), "left", "top"), ((-3, 2), "right", "bottom"),
               ((-3, -2), "right", "top"))
    placed: list[tuple] = []
    for n, ((x, y), label) in enumerate(zip(coords, labels)):
        for offset, ha, va in corners:
            note = ax.annotate(label, (x, y), xytext=offset, textcoords="offset points", ha=ha, va=va,
                               fontsize=fontsize)
            box = note.get_window_extent(renderer).padded(1)
            inside = frame.x0 <= box.x0 and box.x1 <= frame.x1 and frame.y0 <= box.y0 and box.y1 <= frame.y1
            if inside and not any(box.overlaps(other) for _, other in placed):
                placed.append((n, box))
                break
            note.remove()
    return [(n, (b.x0, b.y0, b.x1, b.y1)) for n, b in placed]


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
    """The PCA scatter with as many labels as fit without overlap, in the order given (most important first)."""
    coords, share = pca_2d(vectors)
    fig = new_figure(9, 8)
    ax = fig.add_subplot(1, 1, 1)
    ax.scatter(coords[:, 0], coords[:, 1], s=10, alpha=0.6)
    ax.set_xlabel(f"PC 1 ({share[0]:.1%} of the variance)")
    ax.set_ylabel(f"PC 2 ({share[1]:.1%} of the variance)")
    ax.set_title("\n".join(textwrap.wrap(title or f"PCA of {len(labels)} vectors", 100)), fontsize=10)
    ax.margins(0.08)
    fig.tight_layout()  # before placing: label boxes are measured in the final layout's pixels
    shown = [token_label(label) for label in labels]
    placed = place_labels(fig, ax, coords, shown)
    return save(fig, out, {"labels": list(labels), "coords": coords.tolist(), "variance_share": share.tolist(),
                           "labelled": [n for n, _ in placed], "label_boxes": [list(b) for _, b in placed]},
                layout=False)
