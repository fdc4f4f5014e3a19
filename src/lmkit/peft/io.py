"""Adapters on disk in the PEFT library's folder format: adapter_config.json + adapter_model.safetensors.

Tensor names are the Hugging Face names of the family (`base_model.model.model.layers.0.self_attn.q_proj
.lora_A.weight`), so the PEFT library loads a LoRA, IA3 or prompt-tuning adapter saved here onto the
transformers model, and lmkit loads theirs. Where HF fuses several lmkit layers (GPT-2's c_attn = q, k, v),
LoRA factors are joined exactly: A = [A_q; A_k; A_v], B = blockdiag(B_q, B_k, B_v) (rank 3r, alpha 3 alpha),
and split on loading as A_part = A, B_part = rows of B. Prefix tuning and bottleneck adapters have no PEFT
counterpart with lmkit's layout; they are written in the same folder format with lmkit's names.
"""
from __future__ import annotations

from pathlib import Path

import torch
from torch import nn

from lmkit.errors import CheckpointError, ConfigError
from lmkit.hub.files import atomic_save_safetensors, atomic_write_json, load_safetensors, read_json
from lmkit.peft import adapters, lora, prompt, quant
from lmkit.peft.model import ADAPTER_PARAMS, PeftConfig, PeftModel, mark_trainable
from lmkit.peft.names import hf_groups, hf_param_names, matches, replace_module

CONFIG, WEIGHTS = "adapter_config.json", "adapter_model.safetensors"
PREFIX = "base_model.model."
PEFT_TYPES = {"lora": "LORA", "qlora": "LORA", "ia3": "IA3", "prompt": "PROMPT_TUNING",
              "prefix": "LMKIT_PREFIX_TUNING", "adapter": "LMKIT_BOTTLENECK_ADAPTER"}


def _groups(model: nn.Module, kinds) -> dict[str, list[str]]:
    """HF module -> lmkit parts, for the modules of the given kinds (identity names without a family)."""
    groups = hf_groups(model)
    if groups:
        return groups
    return {n: [n] for n, m in model.named_modules() if isinstance(m, kinds)}


def _task_type(model: nn.Module) -> str | None:
    return "CAUSAL_LM" if type(model).__name__ == "CausalLM" else None


def save_adapter(peft_model: PeftModel, path) -> None:
    """Write the adapter alone (and any modules trained in full) as a PEFT-format folder."""
    model, c = peft_model.base_model, peft_model.peft_config
    folder = Path(path)
    tensors: dict[str, torch.Tensor] = {}
    raw = {"peft_type": PEFT_TYPES[c.method], "task_type": _task_type(model), "base_model_name_or_path": None,
           "inference_mode": True, "revision": None}
    if c.method in ("qlora", "prefix", "adapter"):  # what the PEFT fields cannot say (PEFT ignores it, with a warning)
        raw["lmkit"] = c.to_dict()
    if c.method in ("lora", "qlora"):
        targets, ranks, alphas = [], {}, {}
        layers = lora.lora_layers(model)
        for hf, parts in _groups(model, lora.LoRALinear).items():
            mods = [model.get_submodule(p) for p in parts]
            if not any(isinstance(m, lora.LoRALinear) for m in mods):
                continue
            adapted = [m for m in mods if isinstance(m, lora.LoRALinear)]
            if len({m.scaling for m in adapted}) > 1:
                raise ConfigError(f"LoRA layers fused into {hf} have different alpha/r; give them one alpha/r")
            A = torch.cat([m.lora_A.weight for m in adapted], dim=0)
            rank = A.shape[0]
            B = A.new_zeros(sum(m.out_features for m in mods), rank)
            row = col = 0
            for m in mods:
                if isinstance(m, lora.LoRALinear):
                    B[row:row + m.out_features, col:col + m.r] = m.lora_B.weight
                    col += m.r
                row += m.out_features
            tensors[f"{PREFIX}{hf}.lora_A.weight"] = A
            tensors[f"{PREFIX}{hf}.lora_B.weight"] = B
            targets.append(hf)
            if rank != c.r or rank * adapted[0].scaling != c.alpha:
                ranks[hf], alphas[hf] = rank, rank * adapted[0].scaling
        if not layers:
            raise ConfigError("this model has no LoRA layers to save")
        raw.update(r=c.r, lora_alpha=c.alpha, lora_dropout=c.dropout, target_modules=sorted(targets), bias="none",
                   fan_in_fan_out=getattr(model.config, "family", None) == "gpt2", rank_pattern=ranks,
                   alpha_pattern=alphas, use_rslora=False, use_dora=False, init_lora_weights=True,
                   layers_to_transform=None, layers_pattern=None)
    elif c.method == "ia3":
        targets, ff = [], []
        for hf, parts in _groups(model, adapters.IA3Linear).items():
            mods = [model.get_submodule(p) for p in parts]
            adapted = [m for m in mods if isinstance(m, adapters.IA3Linear)]
            if not adapted:
                continue
            if adapted[0].feedforward:
                tensors[f"{PREFIX}{hf}.ia3_l"] = adapted[0].ia3_l.detach()[None, :]
                ff.append(hf)
            else:
                vec = torch.cat([m.ia3_l.detach() if isinstance(m, adapters.IA3Linear) else
                                 torch.ones(m.out_features, dtype=adapted[0].ia3_l.dtype) for m in mods])
                tensors[f"{PREFIX}{hf}.ia3_l"] = vec[:, None]
            targets.append(hf)
        raw.update(target_modules=sorted(targets), feedforward_modules=sorted(ff), fan_in_fan_out=
                   getattr(model.config, "family", None) == "gpt2", init_ia3_weights=True)
    elif c.method == "prompt":
        emb = next(m for m in model.modules() if isinstance(m, prompt.PromptEmbedding))
        tensors["prompt_embeddings"] = emb.prompt_embeddings.detach()
        raw.update(num_virtual_tokens=c.num_virtual_tokens, token_dim=model.config.d_model,
                   num_transformer_submodules=1, num_attention_heads=model.config.n_heads,
                   num_layers=model.config.n_layers, prompt_tuning_init="RANDOM")
    else:
        for name, p in model.named_parameters():
            if any(f".{a}" in f".{name}" for a in ADAPTER_PARAMS):
                tensors[name] = p.detach()
    if c.modules_to_save:
        names = hf_param_names(model)
        for name, p in model.named_parameters():
            if p.requires_grad and not any(f".{a}" in f".{name}" for a in ADAPTER_PARAMS):
                tensors[PREFIX + names.get(name, name)] = p.detach()
        raw["modules_to_save"] = list(c.modules_to_save)
    folder.mkdir(parents=True, exist_ok=True)
    atomic_save_safetensors({k: v.contiguous() for k, v in tensors.items()}, folder / WEIGHTS)
    atomic_write_json(folder / CONFIG, raw)


def load_adapter(model: nn.Module, path, trainable: bool = False) -> PeftModel:
    """Add the adapter of a PEFT-format folder to `model` (in place) and return the PeftModel."""
    folder = Path(path)
    raw = read_json(folder / CONFIG)
    if not (folder / WEIGHTS).is_file():
        raise CheckpointError(f"{folder / WEIGHTS} is missing; an adapter folder holds {CONFIG} and {WEIGHTS}")
    tensors = load_safetensors(folder / WEIGHTS)
    ours = dict(raw.get("lmkit") or {})
    kind = raw.get("peft_type")
    method = {v: k for k, v in reversed(PEFT_TYPES.items())}.get(kind)  # LORA -> lora
    if method is None:
        raise ConfigError(f"adapter type {kind!r} is not supported; lmkit loads {', '.join(sorted(set(PEFT_TYPES.values())))}")
    if method == "lora" and ours.get("method") == "qlora":
        method = "qlora"
    config = PeftConfig(**{**ours, "method": method})
    if method in ("lora", "qlora"):
        if method == "qlora":
            quant.quantize_linears(model, config.bits, config.block_size, skip=("lm_head", *config.modules_to_save))
        targets = _load_lora(model, raw, tensors, config)
    elif method == "ia3":
        targets = _load_ia3(model, raw, tensors)
    elif method == "prompt":
        targets = prompt.apply_prompt(model, int(raw["num_virtual_tokens"]))
        config.num_virtual_tokens = int(raw["num_virtual_tokens"])
        emb = next(m for m in model.modules() if isinstance(m, prompt.PromptEmbedding))
        with torch.no_grad():
            emb.prompt_embeddings.copy_(tensors["prompt_embeddings"])
    else:
        targets = (prompt.apply_prefix(model, config.num_virtual_tokens) if method == "prefix"
                   else adapters.apply_adapters(model, config.bottleneck))
        _copy(model, {k: v for k, v in tensors.items() if not k.startswith(PREFIX)}, folder)
    if raw.get("modules_to_save"):
        config.modules_to_save = list(raw["modules_to_save"])
        names = {PREFIX + v: k for k, v in hf_param_names(model).items()}
        _copy(model, {names.get(k, k.removeprefix(PREFIX)): v for k, v in tensors.items() if k in names}, folder)
    out = PeftModel(model, config, targets=targets)
    mark_trainable(model, config.modules_to_save)
    if not trainable:
        for p in out.parameters():
            p.requires_grad_(False)
    return out


def _copy(model: nn.Module, state: dict[str, torch.Tensor], folder: Path) -> None:
    params = dict(model.named_parameters())
    for name, t in state.items():
        if name not in params or params[name].shape != t.shape:
            raise CheckpointError(f"{folder / WEIGHTS}: tensor {name} {tuple(t.shape)} does not fit this model")
        with torch.no_grad():
            params[name].copy_(t)


def _suffix_lookup(pattern: dict, hf: str, default):
    for key, value in (pattern or {}).items():
        if matches(hf, [key if not any(ch in key for ch in "*^$[(\\") else "re:" + key]):
            return value
    return default


def _load_lora(model: nn.Module, raw: dict, tensors: dict, config: PeftConfig) -> list[str]:
    if raw.get("use_rslora") or raw.get("use_dora"):
        raise ConfigError("rsLoRA and DoRA adapters are not supported; train a plain LoRA adapter")
    if any(".lora_embedding_" in k for k in tensors):
        raise ConfigError("LoRA on embedding layers is not supported; target linear layers only")
    config.r, config.alpha = int(raw.get("r", config.r)), float(raw.get("lora_alpha", config.alpha))
    config.dropout = float(raw.get("lora_dropout", 0.0))
    groups = _groups(model, (nn.Linear, quant.QuantizedLinear))
    targets = []
    for key in sorted(k for k in tensors if k.endswith(".lora_A.weight")):
        hf = key.removeprefix(PREFIX).removesuffix(".lora_A.weight")
        hf = hf.replace(".base_layer", "")
        if hf not in groups:
            raise CheckpointError(f"adapter tensor {key} names {hf}, which this model does not have")
        A, B = tensors[key], tensors[key.replace(".lora_A.", ".lora_B.")]
        rank = A.shape[0]
        alpha = float(_suffix_lookup(raw.get("alpha_pattern"), hf, config.alpha))
        row = 0
        for part in groups[hf]:
            base = model.get_submodule(part)
            layer = lora.LoRALinear(base, rank, alpha, config.dropout)
            with torch.no_grad():
                layer.lora_A.weight.copy_(A)
                layer.lora_B.weight.copy_(B[row:row + base.out_features])
            row += base.out_features
            replace_module(model, part, layer)
            targets.append(part)
        if row != B.shape[0]:
            raise CheckpointError(f"adapter tensor {key}: B has {B.shape[0]} rows, the layer {row}")
    return targets


def _load_ia3(model: nn.Module, raw: dict, tensors: dict) -> list[str]:
    groups = _groups(model, (nn.Linear, quant.QuantizedLinear))
    ff_patterns = raw.get("feedforward_modules") or []
    ff_patterns = ["re:" + ff_patterns] if isinstance(ff_patterns, str) else ff_patterns
    targets = []
    for key in sorted(k for k in tensors if k.endswith(".ia3_l")):
        hf = key.removeprefix(PREFIX).removesuffix(".ia3_l").replace(".base_layer", "")
        if hf not in groups:
            raise CheckpointError(f"adapter tensor {key} names {hf}, which this model does not have")
        vec, row = tensors[key], 0
        ff = matches(hf, ff_patterns)
        for part in groups[hf]:
            base = model.get_submodule(part)
            layer = adapters.IA3Linear(base, ff)
            with torch.no_grad():
                if ff:
                    layer.ia3_l.copy_(vec.reshape(-1))
                else:
                    layer.ia3_l.copy_(vec.reshape(-1)[row:row + base.out_features])
            row += base.out_features
            replace_module(model, part, layer)
            targets.append(part)
    return targets
