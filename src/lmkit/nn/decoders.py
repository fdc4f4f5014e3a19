"""From a vector back to a token: the nearest embedding and the softmax decoder.

nearest:  D(z) = argmin_w ||E(w) - z||^2 = argmin_w (||E(w)||^2 - 2 E(w).z)   (ties: the lowest id)
softmax:  P(w | z) = softmax_w(E(w)^T z / tau) with each E(w) scaled to unit length (normalize=False: as is)
"""
from __future__ import annotations

import torch


def squared_distances(z: torch.Tensor, E: torch.Tensor) -> torch.Tensor:
    """||E(w) - z||^2 for every w: (..., d), (V, d) -> (..., V), in float32 at least."""
    dtype = torch.promote_types(z.dtype, torch.float32)
    z, E = z.to(dtype), E.to(dtype)
    return (z * z).sum(-1, keepdim=True) - 2 * z @ E.T + (E * E).sum(-1)


def nearest_embedding(z: torch.Tensor, E: torch.Tensor, k: int = 1) -> torch.Tensor:
    """The id of the nearest row of E to each vector z (..., d): (...,), or the k nearest (..., k), nearest first.

    Distances equal to the float precision go to the lower id, as argmin breaks ties."""
    d2 = squared_distances(z, E)
    if k == 1:
        return d2.argmin(-1)
    return torch.sort(d2, dim=-1, stable=True).indices[..., :k]  # stable: lower ids first among equal distances


def softmax_decoder(z: torch.Tensor, E: torch.Tensor, normalize: bool = True, temperature: float = 1.0,
                    log: bool = False) -> torch.Tensor:
    """P(w | z) = softmax(E(w)^T z / temperature) over the vocabulary (..., V); unit-length rows of E when
    normalize. log=True returns log P."""
    dtype = torch.promote_types(z.dtype, torch.float32)
    E = E.to(dtype)
    if normalize:
        E = E / E.norm(dim=-1, keepdim=True).clamp_min(torch.finfo(dtype).tiny)
    scores = (z.to(dtype) @ E.T) / temperature
    return torch.log_softmax(scores, -1) if log else torch.softmax(scores, -1)


def sample_tokens(z: torch.Tensor, E: torch.Tensor, generator: torch.Generator | None = None, **kwargs) -> torch.Tensor:
    """Draw w ~ P(w | z) of the softmax decoder for each z (...,)."""
    p = softmax_decoder(z, E, **kwargs)
    flat = torch.multinomial(p.reshape(-1, p.shape[-1]), 1, generator=generator)
    return flat.view(p.shape[:-1])
