"""The logit-lens grid: layers (rows) by positions (columns), each cell the lens's top next token, colored by
its probability."""
from __future__ import annotations

from pathlib import Path
from typing import Sequence

from lmkit.plots import new_figure, save, token_label


def plot_lens(names: Sequence[str], inputs: Sequence[str], top_tokens: Sequence[Sequence[str]],
              top_probs: Sequence[Sequence[float]], out: str | Path, title: str = "") -> Path:
    """top_tokens[l][t], top_probs[l][t]: the most likely next token after position t read at layer l."""
    import numpy as np

    probs = np.asarray(top_probs, dtype=np.float64)
    L, T = probs.shape
    fig = new_figure(max(6, 1.1 * T + 2), max(3.5, 0.5 * L + 2))
    ax = fig.add_subplot(1, 1, 1)
    # the scale ends at the drawn maximum rounded up to one significant digit (0.0047 -> 0.005, 0.93 -> 1)
    peak = max(float(probs.max()), 1e-6)
    unit = 10.0 ** np.floor(np.log10(peak))
    top = min(1.0, float(np.ceil(peak / unit - 1e-9) * unit))
    im = ax.imshow(probs, aspect="auto", cmap="Blues", vmin=0, vmax=top, origin="lower", interpolation="nearest")
    for l in range(L):
        for t in range(T):
            ax.text(t, l, token_label(top_tokens[l][t]), ha="center", va="center", fontsize=7,
                    color="white" if probs[l, t] > 0.6 * top else "black")
    ax.set_xticks(range(T), [token_label(s) for s in inputs], rotation=45, ha="right", fontsize=7)
    ax.set_yticks(range(L), names, fontsize=7)
    ax.set_xlabel("input token (the cell predicts the next one)")
    ax.set_ylabel("stream read after")
    ax.set_title(title or "logit lens: top next token per layer", fontsize=10)
    fig.colorbar(im, ax=ax, label="probability of the top token")
    return save(fig, out, {"layers": list(names), "inputs": list(inputs), "tokens": [list(r) for r in top_tokens],
                           "probabilities": probs.tolist()})
