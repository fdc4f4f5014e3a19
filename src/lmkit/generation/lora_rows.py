"""LoRA adapters applied per row of a batch, as punica and S-LoRA serve many adapters on one base model.

Row i of a batch that decodes with adapter a gets y_i = x_i W^T + b + s_a (x_i A_a^T) B_a^T at every layer the
adapter targets, and a row of the base model y_i = x_i W^T + b: so requests for different adapters and the base
share one forward, and each row's output is the merged model's, W + s_a B_a A_a, up to rounding. `RowLoRA` wraps
a target linear layer; `Adapters` holds the adapters by name and tells every wrapper which rows take which adapter
in the coming forward (`route`).
"""
from __future__ import annotations

import copy

import torch
from torch import nn

from lmkit.errors import GenerationError

Weights = dict[str, tuple[torch.Tensor, torch.Tensor, float]]  # module name -> (A (r, in), B (out, r), scaling)


class RowLoRA(nn.Module):
    """`base` (a linear layer) plus, for the rows `routes` assigns an adapter, that adapter's s B A x."""

    def __init__(self, base: nn.Module, routes: "Adapters"):
        super().__init__()
        self.base, self.routes = base, routes
        self.pairs: dict[int, tuple[torch.Tensor, torch.Tensor, float]] = {}  # adapter index -> (A, B, s)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        y = self.base(x)
        for index, rows in self.routes.rows.items():
            pair = self.pairs.get(index)
            if pair is None:  # this adapter does not target this layer
                continue
            A, B, scaling = pair
            if rows is None:  # every row
                y = y + (x @ A.t()) @ B.t() * scaling
            else:
                y = y.index_add(0, rows, (x.index_select(0, rows) @ A.t()) @ B.t() * scaling)
        return y


class Adapters:
    """The LoRA adapters one served model decodes with, by name, and the row routing of the coming forward.
    `model` is the model the adapters wrap (a copy of `bare`, the model given, once one is added)."""

    def __init__(self, model: nn.Module):
        self.bare = self.model = model  # `model` stays as it is: the first adapter wraps a copy sharing its weights
        self.names: dict[str, int] = {}
        self.rows: dict[int, torch.Tensor | None] = {}  # adapter index -> the batch rows taking it (None: all)
        self._wrapped: dict[str, RowLoRA] = {}
        self._next = 0  # indices are never reused: a prefix cache keyed by them never mixes two adapters' blocks

    def add(self, name: str, weights: Weights) -> None:
        """Wrap the layers `weights` names (once) and give them the adapter's A, B and scaling under `name`."""
        if name in self.names:
            raise GenerationError(f"an adapter named {name!r} is loaded already; unload it first or pick another name")
        modules = dict(self.model.named_modules())
        for module_name, (A, B, _) in weights.items():
            base = self._wrapped[module_name].base if module_name in self._wrapped else modules.get(module_name)
            if base is None or not hasattr(base, "in_features") \
                    or tuple(A.shape[1:]) != (base.in_features,) or B.shape[0] != base.out_features:
                raise GenerationError(f"adapter {name!r}: its layer {module_name} does not fit the served model; "
                                      "give an adapter trained on this model")
        index, self._next = self._next, self._next + 1
        if self.model is self.bare:
            shared = {id(t): t for t in [*self.bare.parameters(), *self.bare.buffers()]}
            self.model = copy.deepcopy(self.bare, shared)
            modules = dict(self.model.named_modules())
        device = next(self.model.parameters()).device
        dtype = next(self.model.parameters()).dtype
        for module_name, (A, B, scaling) in weights.items():
            if module_name not in self._wrapped:
                parent, _, leaf = module_name.rpartition(".")
                wrapper = RowLoRA(modules[module_name], self)
                setattr(self.model.get_submodule(parent) if parent else self.model, leaf, wrapper)
                self._wrapped[module_name] = wrapper
            self._wrapped[module_name].pairs[index] = (A.detach().to(device, dtype), B.detach().to(device, dtype),
                                                       float(scaling))
        self.names[name] = index

    def remove(self, name: str) -> None:
        index = self.names.pop(name)
        for wrapper in self._wrapped.values():
            wrapper.pairs.pop(index, None)

    def key(self, name: str | None) -> int | None:
        """What the prefix cache keys an adapter's blocks under besides their tokens (None: the base model's)."""
        return None if name is None else self.names[name]

    def route(self, adapters: list[str | None]) -> bool:
        """Route row i of the coming forward to adapter `adapters[i]` (None: the base); whether any row takes one."""
        if not self.names:
            return False
        rows: dict[int, list[int]] = {}
        for i, name in enumerate(adapters):
            if name is not None:
                rows.setdefault(self.names[name], []).append(i)
        device = next(self.model.parameters()).device
        self.rows = {index: None if len(r) == len(adapters) else torch.tensor(r, device=device)
                     for index, r in rows.items()}
        return bool(rows)
