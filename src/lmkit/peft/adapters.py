"""Bottleneck adapters (Houlsby et al. 2019) and IA3 (Liu et al. 2022).

Adapter after a sub-layer F (attention or FFN), inside its residual branch:
    h = F(x);  h + W_up act(W_down h),  W_up starts at zero so the model starts unchanged.
IA3 rescales activations by learned vectors that start at one:
    keys l_k * (W_k x), values l_v * (W_v x), FFN activations W_down (l_ff * a).
"""
from __future__ import annotations

import torch
from torch import nn

from lmkit.config import ModelConfig
from lmkit.errors import ConfigError
from lmkit.nn.blocks import Residual
from lmkit.nn.ffn import activation
from lmkit.peft.names import WrappedLinear, find_modules, hf_names, matches, replace_module, untie_shared_bases
from lmkit.peft.quant import QuantizedLinear


class BottleneckAdapter(nn.Module):
    """A sub-layer followed by h + up(act(down(h))); keeps the sub-layer's other attributes reachable."""

    def __init__(self, sublayer: nn.Module, d_model: int, bottleneck: int, act: str = "relu"):
        super().__init__()
        self.sublayer = sublayer
        w = next(sublayer.parameters())
        self.adapter_down = nn.Linear(d_model, bottleneck, device=w.device, dtype=w.dtype)
        self.adapter_up = nn.Linear(bottleneck, d_model, device=w.device, dtype=w.dtype)
        nn.init.normal_(self.adapter_down.weight, std=1e-2)
        nn.init.zeros_(self.adapter_down.bias)
        nn.init.zeros_(self.adapter_up.weight)
        nn.init.zeros_(self.adapter_up.bias)
        self.act = activation(act)

    def forward(self, x: torch.Tensor, **kwargs) -> torch.Tensor:
        h = self.sublayer(x, **kwargs)
        return h + self.adapter_up(self.act(self.adapter_down(h)))


def apply_adapters(model: nn.Module, bottleneck: int = 16, where: tuple[str, ...] = ("self_attn", "mlp"),
                   act: str = "relu") -> list[str]:
    """Insert a BottleneckAdapter after the chosen sub-layers of every block; the names changed."""
    config: ModelConfig = model.config
    names = []
    for name, module in list(model.named_modules()):
        if isinstance(module, Residual) and name.rpartition(".")[2] in where:
            module.sublayer = BottleneckAdapter(module.sublayer, config.d_model, bottleneck, act)
            names.append(f"{name}.sublayer")
    if not names:
        raise ConfigError(f"no sub-layer named {where} to put adapters after; use self_attn, cross_attn or mlp")
    return names


class IA3Linear(WrappedLinear):
    """A frozen linear layer whose output (or, for FFN layers, input) is scaled by a learned vector `ia3_l`."""

    def __init__(self, base_layer: nn.Module, feedforward: bool):
        super().__init__()
        self.base_layer = base_layer
        self.feedforward = feedforward
        w = base_layer.weight
        size = base_layer.in_features if feedforward else base_layer.out_features
        self.ia3_l = nn.Parameter(torch.ones(size, device=w.device, dtype=w.dtype))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if self.feedforward:
            return self.base_layer(x * self.ia3_l.to(x.dtype))
        return self.base_layer(x) * self.ia3_l.to(x.dtype)

    @torch.no_grad()
    def merged_linear(self) -> nn.Linear:
        """A plain nn.Linear computing the same: W diag(l) (feed-forward), else diag(l) W with bias l * b."""
        base, scale = self.base_layer, self.ia3_l.detach().float()
        w = base.weight.detach().float()   # dequantized when the base is quantized
        out = nn.Linear(self.in_features, self.out_features, bias=base.bias is not None, device=w.device)
        out.weight.copy_(w * scale if self.feedforward else w * scale[:, None])
        if base.bias is not None:
            out.bias.copy_(base.bias.float() if self.feedforward else base.bias.float() * scale)
        return out.to(self.ia3_l.dtype)


def merge_ia3(model: nn.Module) -> nn.Module:
    """Replace each IA3Linear by the plain linear layer it computes (PEFT's merge_and_unload); returns the model."""
    layers = {n: m for n, m in model.named_modules() if isinstance(m, IA3Linear)}
    untie_shared_bases(model, layers.values())
    for name, m in layers.items():
        replace_module(model, name, m.merged_linear())
    return model


def apply_ia3(model: nn.Module, target_modules=("k_proj", "v_proj", "down_proj"),
              feedforward_modules=("down_proj",)) -> list[str]:
    """Wrap the matching linear layers in IA3Linear (input-scaled when they match feedforward_modules)."""
    names = find_modules(model, target_modules, (nn.Linear, QuantizedLinear))
    if not names:
        raise ConfigError(f"no linear layer matches target_modules={target_modules!r}")
    hf = hf_names(model)
    for name in names:
        ff = matches(name, feedforward_modules, hf.get(name))
        replace_module(model, name, IA3Linear(model.get_submodule(name), ff))
    return names
