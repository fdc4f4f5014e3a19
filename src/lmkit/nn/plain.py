"""The one rule for "may a fused path bypass this module's forward?".

A fused path (the joined q/k/v product, GELU with its bias, pruning a block's outputs to the kept positions,
the decoding plan) computes what a module's own forward computes from its weights, without calling it. That is
exact only while the module runs the forward the path reproduces: an instance of `kind` whose class keeps
`kind`'s forward (LoRA, IA3 and prefix wrappers, quantized layers are other classes or override it), and that no
forward hook watches or changes (hooks of `lens`, head pruning's masks on the output projection, torch's
pruning) and whose weights are what it holds (not computed by `torch.nn.utils.parametrize`, as weight norm's
are). Whatever else a fused path needs (no cross-attention, no experts ...) its caller checks.
"""
from __future__ import annotations

from torch import nn


def hooked(module: nn.Module) -> bool:
    """A forward hook or pre-hook is registered on `module` itself, or its weights are parametrized (computed by
    `torch.nn.utils.parametrize` modules, which it keeps under `parametrizations`)."""
    return bool(module._forward_hooks or module._forward_pre_hooks or "parametrizations" in module._modules)


def plain(module: nn.Module | None, kind: type | tuple[type, ...], deep: bool = False) -> bool:
    """`module` runs `kind`'s own forward (one of them, for a tuple) on its own weights, with no forward hook on
    it, nor with `deep` on any module inside it. None is not plain."""
    if module is None or not isinstance(module, kind):
        return False
    kinds = kind if isinstance(kind, tuple) else (kind,)
    if not any(isinstance(module, k) and type(module).forward is k.forward for k in kinds):
        return False
    return unhooked(module) if deep else not hooked(module)


def unhooked(module: nn.Module) -> bool:
    """No module inside `module` (itself included) is `hooked`."""
    return not any(hooked(m) for m in module.modules())
