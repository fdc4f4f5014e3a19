"""Walks of autograd graphs: which Functions a result went through."""
from __future__ import annotations

import torch


def graph_nodes(t: torch.Tensor) -> set[str]:
    """Names of every autograd node behind t."""
    seen, todo, names = set(), [t.grad_fn], set()
    while todo:
        node = todo.pop()
        if node is None or node in seen:
            continue
        seen.add(node)
        names.add(type(node).__name__)
        todo.extend(n for n, _ in node.next_functions)
    return names
