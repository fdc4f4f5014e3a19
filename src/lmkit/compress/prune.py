"""Attention-head pruning (Michel, Levy and Neubig 2019, "Are Sixteen Heads Really Better than One?").

Each head h gets a gate xi_h = 1 on its output; its importance is I_h = sum over batches of |dL/dxi_h|
(the expected loss change to first order when the head is removed), normalised to unit L2 norm per
layer. Pruning removes the least important heads structurally: the rows of q/k/v_proj and the columns
of o_proj that belong to them, so the model gets smaller and cheaper, and is saved and reloaded that way.
A pruned model computes exactly what the unpruned one does with those heads' outputs zeroed (head mask 0),
including a layer left with no heads (its attention adds o_proj's bias). Under grouped-query attention a
key/value head goes with its last query head; `least_important` removes whole groups (single heads under MQA).
"""
from __future__ import annotations

import contextlib
import dataclasses
import math
import warnings

import torch
from torch import nn

from lmkit.device import module_device
from lmkit.errors import ConfigError
from lmkit.hub.hooks import FolderHook, register_folder_hook
from lmkit.nn.attention import Attention


def attention_modules(model: nn.Module) -> dict[str, Attention]:
    return {n: m for n, m in model.named_modules() if isinstance(m, Attention)}


@contextlib.contextmanager
def head_gates(model: nn.Module):
    """Gates xi (n_heads,) = 1 on every attention module's heads, multiplying each head's output."""
    gates, hooks = {}, []
    for name, attn in attention_modules(model).items():
        gate = torch.ones(attn.n_heads, device=attn.o_proj.weight.device, requires_grad=True)
        gates[name] = gate

        def hook(module, args, gate=gate, dim=attn.head_dim):
            return (args[0] * gate.repeat_interleave(dim).to(args[0].dtype),)

        hooks.append(attn.o_proj.register_forward_pre_hook(hook))
    try:
        yield gates
    finally:
        for h in hooks:
            h.remove()


def causal_lm_loss(model: nn.Module, batch: torch.Tensor) -> torch.Tensor:
    """Mean next-token loss of rows (B, T + 1), run where the model is."""
    batch = batch.to(module_device(model))
    out = model(batch[:, :-1])
    return nn.functional.cross_entropy(out.logits.reshape(-1, out.logits.shape[-1]).float(), batch[:, 1:].reshape(-1))


def head_importance(model: nn.Module, batches, loss_fn=causal_lm_loss, normalize: bool = True) -> dict[str, torch.Tensor]:
    """I_h = sum_batches |dL/dxi_h| per attention module (n_heads,), L2-normalised per layer."""
    was_training = model.training
    model.eval()
    total: dict[str, torch.Tensor] = {}
    with head_gates(model) as gates:
        for batch in batches:
            loss = loss_fn(model, batch)
            grads = torch.autograd.grad(loss, list(gates.values()))
            for name, g in zip(gates, grads):
                total[name] = total.get(name, 0) + g.detach().abs().float()
    model.train(was_training)
    if normalize:
        total = {n: v / v.norm().clamp(min=1e-20) for n, v in total.items()}
    return total


def _rows(heads: list[int], dim: int) -> torch.Tensor:
    return torch.cat([torch.arange(h * dim, (h + 1) * dim) for h in heads]) if heads else torch.zeros(0, dtype=torch.long)


def _linear(n_in: int, n_out: int, bias: bool, device: torch.device, dtype: torch.dtype) -> nn.Linear:
    """An uninitialised nn.Linear (its weights are copied or loaded next); 0 inputs once every head is gone."""
    with warnings.catch_warnings():
        warnings.filterwarnings("ignore", "Initializing zero-element tensors")
        return nn.utils.skip_init(nn.Linear, n_in, n_out, bias=bias, device=device, dtype=dtype)


def _sliced(linear: nn.Linear, index: torch.Tensor, dim: int) -> nn.Linear:
    w = linear.weight.detach().index_select(dim, index.to(linear.weight.device))
    out = _linear(w.shape[1], w.shape[0], linear.bias is not None, w.device, w.dtype)
    with torch.no_grad():
        out.weight.copy_(w)
        if linear.bias is not None:
            out.bias.copy_(linear.bias.detach() if dim == 1 else linear.bias.detach()[index])
    return out


def _check_heads(attn: Attention, heads, name: str = "this attention module", n_heads: int | None = None) -> None:
    for proj in (attn.q_proj, attn.k_proj, attn.v_proj, attn.o_proj):
        if not isinstance(proj, nn.Linear):
            raise ConfigError(f"cannot prune a {type(proj).__name__} projection; merge adapters (merge_and_unload) first")
    n = attn.n_heads if n_heads is None else n_heads
    bad = sorted({int(h) for h in heads if not 0 <= int(h) < n})
    if bad:
        raise ConfigError(f"{name} has {n} heads, numbered 0..{n - 1}; head indices {bad} are out of range")


def prune_attention(attn: Attention, heads: list[int]) -> list[int]:
    """Remove query heads `heads` (its current numbering) from one module; returns the kept heads.

    Under grouped-query attention a key/value head goes when its last query head goes. The kept query
    heads of each group must come out as equal groups: with c_j kept in group j, the groups become
    gcd(c) heads each and key/value head j is repeated c_j / gcd(c) times (exact: copies give the same keys),
    so MQA loses single heads and GQA whole groups at no extra cost. Removing every head leaves o_proj's bias.
    """
    _check_heads(attn, heads)
    remove = sorted(set(int(h) for h in heads))
    if not remove:
        return list(range(attn.n_heads))
    group = attn.n_heads // attn.n_kv_heads
    keep = [h for h in range(attn.n_heads) if h not in remove]
    counts = {j: sum(1 for h in keep if h // group == j) for j in range(attn.n_kv_heads)}
    size = math.gcd(*counts.values())
    keep_kv = [j for j in range(attn.n_kv_heads) for _ in range(counts[j] // size)] if size else []
    D = attn.head_dim
    attn.q_proj = _sliced(attn.q_proj, _rows(keep, D), 0)
    attn.k_proj = _sliced(attn.k_proj, _rows(keep_kv, D), 0)
    attn.v_proj = _sliced(attn.v_proj, _rows(keep_kv, D), 0)
    attn.o_proj = _sliced(attn.o_proj, _rows(keep, D), 1)
    for extra in getattr(attn, "query_head_projections", ()):  # Longformer's global projections follow the heads
        setattr(attn, extra, _sliced(getattr(attn, extra), _rows(keep, D), 0))
    attn.n_heads, attn.n_kv_heads = len(keep), len(keep_kv)
    return keep


def pruned_heads(model: nn.Module) -> dict[str, list[int]]:
    """{attention module name: its heads pruned so far, in the original numbering} (config.compression.pruned_heads)."""
    return {k: list(v) for k, v in model.config.compression.get("pruned_heads", {}).items()}


def original_heads(model: nn.Module, name: str) -> list[int]:
    """The original indices of module `name`'s current heads, in order (current head i is original head [i])."""
    gone = set(pruned_heads(model).get(name, []))
    total = model.get_submodule(name).n_heads + len(gone)
    return [h for h in range(total) if h not in gone]


def prune_heads(model: nn.Module, heads: dict[str, list[int]]) -> None:
    """Prune heads {attention module name: head indices} structurally.

    As in transformers' `prune_heads`, indices are the original ones (before any pruning), heads pruned
    earlier are skipped, and config.compression.pruned_heads records the union (transformers' `pruned_heads`).
    The model then saves in lmkit's own format (Hugging Face formats have one head count for all
    layers); config.compression.attention_heads records each module's (query heads, key/value heads).
    """
    if model.config.position == "relative":
        raise ConfigError("heads cannot be pruned with T5's relative position bias, which all layers share per head")
    modules = attention_modules(model)
    layout = dict(model.config.compression.get("attention_heads", {}))
    record = pruned_heads(model)
    for name, remove in heads.items():   # check everything before changing anything
        if name not in modules:
            raise ConfigError(f"{name} is not an attention module of this model; names look like {next(iter(modules))}")
        _check_heads(modules[name], remove, name, modules[name].n_heads + len(record.get(name, [])))
    for name, remove in heads.items():
        kept = original_heads(model, name)
        current = [kept.index(h) for h in sorted({int(h) for h in remove}) if h in kept]
        if current:
            prune_attention(modules[name], current)
            layout[name] = [modules[name].n_heads, modules[name].n_kv_heads]
            record[name] = sorted(set(record.get(name, [])) | {kept[i] for i in current})
    model.config.compression = dataclasses.replace(model.config.compression, attention_heads=layout, pruned_heads=record)
    model.config.family = None


def _group_size(attn: nn.Module) -> int:
    """Query heads removed together: those sharing a key/value head under GQA; one under MHA and MQA."""
    return 1 if attn.n_kv_heads == 1 else attn.n_heads // attn.n_kv_heads


def least_important(importance: dict[str, torch.Tensor], n: int, model: nn.Module) -> dict[str, list[int]]:
    """The n heads of lowest importance (per current head), at least one kept per layer, in the original
    numbering prune_heads takes. Under GQA whole groups are removed (scored by their sum, counted in query
    heads), so no key/value head is copied; under MQA single heads."""
    modules = attention_modules(model)
    units = []  # (score, module, heads of the unit)
    for name, score in importance.items():
        attn = modules[name]
        if not attn.n_heads:
            continue
        g = _group_size(attn)
        for k in range(attn.n_heads // g):
            heads = list(range(k * g, (k + 1) * g))
            units.append((float(score[heads].sum()), name, heads))
    units.sort(key=lambda u: u[0])
    chosen: dict[str, list[int]] = {}
    left = {name: modules[name].n_heads for name in importance}
    pruned = 0
    for _, name, heads in units:
        if pruned + len(heads) > n:
            continue
        if left[name] - len(heads) < 1:
            continue
        chosen.setdefault(name, []).extend(heads)
        left[name] -= len(heads)
        pruned += len(heads)
    if pruned != n:
        reachable = {0}  # totals that whole units can make, one unit kept per layer
        for name in importance:
            if modules[name].n_heads:
                g = _group_size(modules[name])
                reachable = {r + k * g for r in reachable for k in range(modules[name].n_heads // g)}
        near = [r for r in (max(r for r in reachable if r < n), min((r for r in reachable if r > n), default=0)) if r]
        raise ConfigError(f"cannot prune exactly {n} heads keeping one per layer (in whole groups of query heads "
                          f"under grouped-query attention); {' or '.join(map(str, near)) or 'none'} can be: ask for that many")
    return {name: sorted(original_heads(model, name)[h] for h in hs) for name, hs in chosen.items()}


def apply_head_layout(model: nn.Module) -> nn.Module:
    """Give a freshly built model the head counts config.compression.attention_heads records (before loading weights)."""
    layout = model.config.compression.get("attention_heads") or {}
    modules = attention_modules(model)
    for name, (n_heads, n_kv) in layout.items():
        attn = modules[name]
        D, d = attn.head_dim, attn.q_proj.in_features
        bias = attn.q_proj.bias is not None
        at = dict(device=attn.q_proj.weight.device, dtype=attn.q_proj.weight.dtype)
        attn.q_proj = _linear(d, n_heads * D, bias, **at)
        attn.k_proj = _linear(d, n_kv * D, bias, **at)
        attn.v_proj = _linear(d, n_kv * D, bias, **at)
        attn.o_proj = _linear(n_heads * D, attn.o_proj.out_features, attn.o_proj.bias is not None, **at)
        for extra in getattr(attn, "query_head_projections", ()):
            setattr(attn, extra, _linear(d, n_heads * D, bias, **at))
        attn.n_heads, attn.n_kv_heads = n_heads, n_kv
    return model


register_folder_hook(FolderHook("attention_heads", build=apply_head_layout))
