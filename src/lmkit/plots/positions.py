"""Pictures of position encodings: the sinusoidal table and RoPE's score as a function of the offset.

Sinusoidal: P[i, 2m] = sin(i / base^(2m/d)), P[i, 2m+1] = cos(i / base^(2m/d)); wavelengths 2 pi base^(2m/d),
a geometric series from 2 pi to 2 pi base. RoPE: score(m, n) = (R_m q) . (R_n k) = sum_j Re[(q_j k_j*) e^{i (m - n) theta_j}]
in complex pairs, a function of m - n alone.
"""
from __future__ import annotations

from pathlib import Path

import torch

from lmkit.nn.positions import apply_rotary, rope_inverse_frequencies, sinusoidal_table
from lmkit.plots import new_figure, save


def rope_scores(q: torch.Tensor, k: torch.Tensor, positions_q: torch.Tensor, position_k: int,
                theta: float = 10000.0) -> torch.Tensor:
    """(R_m q) . (R_n k) for each m in positions_q and n = position_k, by lmkit's rotary embedding (half-split pairs)."""
    dim = q.shape[-1]
    inv_freq = rope_inverse_frequencies(dim, theta).double()

    def rotate(x: torch.Tensor, pos: torch.Tensor) -> torch.Tensor:
        angles = pos.double()[:, None] * inv_freq
        emb = torch.cat((angles, angles), -1)
        return apply_rotary(x.double().expand(1, 1, len(pos), dim), emb.cos()[None], emb.sin()[None])[0, 0]

    qs = rotate(q, positions_q)
    kn = rotate(k, torch.tensor([position_k]))[0]
    return qs @ kn


def plot_positions(out: str | Path, n_positions: int = 128, dim: int = 128, base: float = 10000.0,
                   rope_dim: int = 64, max_offset: int = 256, seed: int = 0) -> Path:
    """positions.png: the sinusoidal heatmap (position x dimension) and RoPE's q.k against m - n for a fixed
    random q with k = q, drawn at two key positions n to show that only the offset matters."""
    table = sinusoidal_table(n_positions, dim, base)
    g = torch.Generator().manual_seed(seed)
    q = torch.randn(rope_dim, generator=g)
    k = q  # a key equal to the query: the score peaks at |q|^2 at offset 0 and falls off with the offset
    offsets = torch.arange(-max_offset, max_offset + 1)
    curves = {n: rope_scores(q, k, offsets + n, n) for n in (0, 1000)}
    fig = new_figure(12, 4.5)
    ax = fig.add_subplot(1, 2, 1)
    im = ax.imshow(table.numpy(), aspect="auto", cmap="RdBu", vmin=-1, vmax=1, interpolation="nearest")
    ax.set_xlabel("dimension")
    ax.set_ylabel("position")
    ax.set_title(f"sinusoidal encoding (d = {dim}, base {base:g})")
    fig.colorbar(im, ax=ax)
    ax = fig.add_subplot(1, 2, 2)
    for n, s in curves.items():
        ax.plot(offsets.numpy(), s.numpy(), linewidth=1, linestyle="-" if n == 0 else "--", label=f"key at n = {n}")
    ax.set_xlabel("offset m - n")
    ax.set_ylabel("(R_m q) . (R_n k)")
    ax.set_title(f"RoPE score against the offset (d = {rope_dim})")
    ax.legend()
    ax.grid(alpha=0.3)
    data = {"sinusoidal": table.tolist(), "base": base, "offsets": offsets.tolist(), "q": q.tolist(),
            "rope": {str(n): s.tolist() for n, s in curves.items()}}
    return save(fig, out, data)
