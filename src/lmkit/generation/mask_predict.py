"""Generating from a masked LM, which cannot read left to right: iterative mask filling.

Mask-Predict (Ghazvininejad et al. 2019): the N target positions start all masked; iteration 0 predicts every one;
iteration t = 1 .. T-1 masks again the n_t = floor(N (T - t) / T) tokens of lowest probability and predicts those
alone (the others keep their token and probability), so the masked share falls linearly to none. Gibbs-style
resampling (Wang and Cho 2019): one position at a time, in random order, masked and drawn again from the model's
distribution given all the others. Special tokens are never predicted. The model is any masked LM whose output
has `.logits` (B, T, V).
"""
from __future__ import annotations

import torch

from lmkit.errors import GenerationError


def remask_counts(length: int, iterations: int) -> list[int]:
    """How many of `length` positions are masked at each iteration: N first, then floor(N (T - t) / T)."""
    if iterations < 1:
        raise GenerationError(f"Mask-Predict needs at least one iteration, got {iterations}")
    return [length] + [length * (iterations - t) // iterations for t in range(1, iterations)]


def _scores(model, ids: torch.Tensor, banned: torch.Tensor, temperature: float) -> torch.Tensor:
    logits = model(ids, attention_mask=torch.ones_like(ids)).logits[0].float()
    logits[:, banned] = -torch.inf
    return torch.log_softmax(logits / max(temperature, 1e-6), dim=-1)


@torch.no_grad()
def mask_predict(model, prefix: list[int], length: int, mask_id: int, suffix: list[int] = (), iterations: int = 10,
                 special_ids: list[int] = (), temperature: float = 0.0,
                 generator: torch.Generator | None = None) -> tuple[list[int], list[list[int]]]:
    """(the `length` generated ids, the ids after each iteration) between `prefix` and `suffix`. temperature 0:
    each masked position takes its most likely token; above 0: a sample at that temperature."""
    device = next(model.parameters()).device
    ids = torch.tensor([list(prefix) + [mask_id] * length + list(suffix)], device=device)
    span = torch.arange(len(prefix), len(prefix) + length, device=device)
    banned = torch.tensor(sorted(set(special_ids) | {mask_id}), device=device, dtype=torch.long)
    probs = torch.zeros(length, device=device)
    history = []
    for masked_count in remask_counts(length, iterations):
        if masked_count == 0:
            break
        masked = probs.argsort()[:masked_count]  # the least confident (all at the first iteration)
        ids[0, span[masked]] = mask_id
        logp = _scores(model, ids, banned, temperature)[span[masked]]
        if temperature > 0:
            tokens = torch.multinomial(logp.exp().cpu(), 1, generator=generator).squeeze(1).to(device)
        else:
            tokens = logp.argmax(-1)
        ids[0, span[masked]] = tokens
        probs[masked] = logp.gather(1, tokens[:, None]).squeeze(1).exp()
        history.append(ids[0, span].tolist())
    return ids[0, span].tolist(), history


@torch.no_grad()
def gibbs_resample(model, ids: list[int], positions: list[int], mask_id: int, steps: int, special_ids: list[int] = (),
                   temperature: float = 1.0, generator: torch.Generator | None = None) -> list[int]:
    """`ids` after `steps` single-position draws: each masks one of `positions` (a random order, sweep after sweep)
    and samples it from the model's distribution given every other token."""
    device = next(model.parameters()).device
    row = torch.tensor([list(ids)], device=device)
    banned = torch.tensor(sorted(set(special_ids) | {mask_id}), device=device, dtype=torch.long)
    order: list[int] = []
    for _ in range(steps):
        if not order:
            order = [positions[i] for i in torch.randperm(len(positions), generator=generator).tolist()]
        p = order.pop()
        row[0, p] = mask_id
        logp = _scores(model, row, banned, temperature if temperature > 0 else 1.0)[p]
        row[0, p] = int(torch.multinomial(logp.exp().cpu(), 1, generator=generator))
    return row[0].tolist()
