"""Post-training dynamic int8 quantization of linear layers, for CPU inference.

Weights are stored as int8 with one scale per tensor (w ~ s q, symmetric: zero point 0); at run time each
activation batch is quantized with its own range, multiplied in int8 with int32 accumulation
(fbgemm / onednn) and rescaled: y ~ s_x s_w (q_x q_w^T) + b. This is torch.ao.quantization.quantize_dynamic
on the chosen layers; embeddings, norms, a tied LM head and empty layers (a pruned layer's 0-wide
projections, which the int8 kernel does not handle) stay in float32.
On disk (safetensors, no pickle) a layer is `name.weight` (int8 q), `name.weight_scale` (float64 s),
`name.weight_zero_point` (int64) and `name.bias`; config.compression.quantization lists the layers.
"""
from __future__ import annotations

import copy
import dataclasses
import warnings

import torch
from torch import nn

from lmkit.errors import ConfigError
from lmkit.hub.hooks import FolderHook, register_folder_hook

METHOD = "dynamic-int8"


def _int8_linear_class() -> type:
    return torch.ao.nn.quantized.dynamic.Linear


def quantized_linears(model: nn.Module) -> dict[str, nn.Module]:
    """The dynamically quantized linear layers of a model, by name."""
    cls = _int8_linear_class()
    return {n: m for n, m in model.named_modules() if isinstance(m, cls)}


def quantizable_linears(model: nn.Module) -> list[str]:
    """Names of the nn.Linear layers quantize_dynamic_int8 converts: not a head tied to an embedding, not empty."""
    tied = {id(p) for m in model.modules() if isinstance(m, nn.Embedding) for p in m.parameters()}
    return [name for name, m in model.named_modules()
            if isinstance(m, nn.Linear) and id(m.weight) not in tied and m.weight.numel() > 0]


def quantize_dynamic_int8(model: nn.Module, modules: list[str] | None = None) -> nn.Module:
    """A float32 copy of `model` whose linear layers (`modules`, default quantizable_linears) are int8."""
    names = quantizable_linears(model) if modules is None else list(dict.fromkeys(modules))   # each once
    for name in names:  # torch skips unknown names and fails deep inside on other kinds of layer
        layer = model.get_submodule(name) if name in dict(model.named_modules()) else None
        if not isinstance(layer, nn.Linear) or layer.weight.numel() == 0:
            what = "is not a layer of this model" if layer is None else f"is {type(layer).__name__}, not nn.Linear" if not \
                isinstance(layer, nn.Linear) else "has no weights (a pruned layer's 0-wide projection)"
            raise ConfigError(f"cannot quantize {name!r}: it {what}; name non-empty nn.Linear layers such as "
                              f"{', '.join(quantizable_linears(model)[:2]) or 'q_proj'}")
    if not names:
        done = " (it is already quantized)" if quantized_linears(model) else ""
        raise ConfigError(f"{type(model).__name__} has no float nn.Linear layer to quantize{done}; dynamic int8 "
                          "quantization converts linear layers only")
    q = copy.deepcopy(model).float().eval()
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")  # torch marks its quantized tensor types as deprecated; they still run
        q = torch.ao.quantization.quantize_dynamic(q, set(names), dtype=torch.qint8)
    config = getattr(q, "config", None)
    if config is not None:  # Hugging Face formats have no such layers: the model saves in lmkit's own format
        config.compression = dataclasses.replace(config.compression, quantization={"method": METHOD, "modules": sorted(names)})
        config.family = None
        tied = {id(p) for m in model.modules() if isinstance(m, nn.Embedding) for p in m.parameters()}
        if any(id(model.get_submodule(n).weight) in tied for n in names):  # an int8 head no longer shares the
            q.config = config.replace(tie_embeddings=False)                 # float embedding: saved apart
    return q


def int8_tensors(model: nn.Module) -> dict[str, torch.Tensor]:
    """The int8 layers as plain tensors (q, s, zero point, bias), the way they are saved."""
    out = {}
    for name, m in quantized_linears(model).items():
        w, b = m.weight(), m.bias()
        if w.qscheme() != torch.per_tensor_affine:
            raise ConfigError(f"{name} is quantized per channel; lmkit saves per-tensor int8 layers only")
        out[f"{name}.weight"] = w.int_repr().contiguous()
        out[f"{name}.weight_scale"] = torch.tensor(w.q_scale(), dtype=torch.float64)
        out[f"{name}.weight_zero_point"] = torch.tensor(w.q_zero_point(), dtype=torch.int64)
        if b is not None:
            out[f"{name}.bias"] = b.detach().float().contiguous()
    return out


def split_int8(tensors: dict[str, torch.Tensor], modules: list[str]) -> tuple[dict, dict]:
    """(tensors with each int8 weight dequantized to float32 s (q - z), so a float model loads them;
    the int8 layers' own tensors for restore_int8)."""
    plain, int8 = dict(tensors), {}
    for name in modules:
        keys = [f"{name}.weight", f"{name}.weight_scale", f"{name}.weight_zero_point"]
        missing = [k for k in keys if k not in plain]
        if missing:
            raise ConfigError(f"the weights lack {', '.join(missing)} of the int8 layer {name}; the folder is incomplete")
        q, s, z = (plain.pop(k) for k in keys)
        int8[name] = (q, s, z, plain.get(f"{name}.bias"))
        plain[f"{name}.weight"] = (q.float() - z.float()) * s.float()
    return plain, int8


def restore_int8(model: nn.Module, int8: dict[str, tuple]) -> nn.Module:
    """Quantize `model`'s layers named in `int8` and give them exactly the saved int8 values and scales."""
    q = quantize_dynamic_int8(model, list(int8))
    layers = quantized_linears(q)
    for name, (values, scale, zero, bias) in int8.items():
        weight = torch._make_per_tensor_quantized_tensor(values.to(torch.int8), float(scale), int(zero))
        layers[name].set_weight_bias(weight, bias)
    return q


def weight_bytes(model: nn.Module) -> int:
    """Bytes of the model's weights as saved: float parameters and persistent buffers at their size (a tied
    one once), int8 layers as int8_tensors writes them."""
    saved = set(model.state_dict())
    tensors = list(model.parameters()) + [b for n, b in model.named_buffers() if n in saved]
    total = sum(t.numel() * t.element_size() for t in int8_tensors(model).values())
    return total + sum(t.numel() * t.element_size() for t in {id(t): t for t in tensors}.values())


def _read_int8(tensors: dict[str, torch.Tensor], config, dtype: torch.dtype | None, folder) -> tuple[dict, dict]:
    """A folder's int8 layers: loaded dequantized into a float model, then given their exact int8 values."""
    if dtype not in (None, torch.float32):
        raise ConfigError(f"{folder} holds an int8-quantized model, which runs in float32; load it without dtype")
    return split_int8(tensors, config.compression.quantization.get("modules", []))


register_folder_hook(FolderHook("quantization", read=_read_int8, restore=restore_int8, tensors=int8_tensors))
