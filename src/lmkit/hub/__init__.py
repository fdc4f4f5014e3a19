"""Hugging Face format import/export: config mapping and weight-name tables per family.

`load_model(path)` reads a folder (config.json + model.safetensors or a sharded index) of any
supported family; `save_pretrained(model, path)` writes one that transformers loads.
A folder whose config.json has no `model_type` but an `lmkit` config is read as lmkit's own.
"""
from __future__ import annotations

import dataclasses
import importlib
from pathlib import Path

import torch

from lmkit.atomic import atomic_write_json
from lmkit.config import ModelConfig
from lmkit.device import resolve_device
from lmkit.errors import CheckpointError, ConfigError
from lmkit.generation.config import GenerationConfig
from lmkit.hub.convert import DECODER_HEAD_TENSORS, from_hf, to_hf
from lmkit.hub.family import Family
from lmkit.hub.files import read_json, read_weights, write_weights
from lmkit.hub.hooks import folder_hooks
from lmkit.models import build_model
from lmkit.models.base import register_folder_writer

# the modules of lmkit.hub that each define FAMILY, a `Family` (hub/family.py)
FAMILY_MODULES = ("gpt2", "llama", "mistral", "qwen2", "mixtral", "bert", "roberta", "distilbert", "t5", "bart",
                  "mbart", "xlnet", "longformer", "big_bird")


def _families() -> dict[str, Family]:
    """model_type -> its family, for every family module present."""
    out = {}
    for name in FAMILY_MODULES:
        try:
            module = importlib.import_module(f"lmkit.hub.{name}")
        except ModuleNotFoundError as exc:
            if exc.name == f"lmkit.hub.{name}":
                continue
            raise
        for model_type in module.FAMILY.model_types:
            out[model_type] = module.FAMILY
    return out


def family_of(model_type: str | None) -> Family:
    families = _families()
    if not isinstance(model_type, str) or model_type not in families:
        raise ConfigError(f"config.json has model_type {model_type!r}, which lmkit does not load; supported: "
                          f"{', '.join(sorted(families))}")
    return families[model_type]


def load_config(path: str | Path) -> tuple[ModelConfig, dict]:
    """(lmkit config, the raw config.json) of a model folder."""
    folder = Path(path)
    if not folder.is_dir():
        raise CheckpointError(f"{folder} is not a folder; pass a model folder holding config.json and model.safetensors")
    raw = read_json(folder / "config.json")
    try:
        if "lmkit" in raw and "model_type" not in raw:
            if not isinstance(raw["lmkit"], dict):
                raise ConfigError("its 'lmkit' entry must be a JSON object of ModelConfig fields")
            return ModelConfig.from_dict(raw["lmkit"]), raw
        family = family_of(raw.get("model_type"))
        config = family.config_from_hf(raw)
        return (pruned_layout(config, raw["pruned_heads"]) if raw.get("pruned_heads") else config), raw
    except ConfigError as exc:
        raise ConfigError(f"{folder / 'config.json'}: {exc}") from None
    except (TypeError, ValueError, KeyError, AttributeError, IndexError, ArithmeticError) as exc:
        # values of the wrong JSON type reach the family's converter (a list where a number belongs, ...)
        raise ConfigError(f"{folder / 'config.json'} has a malformed field ({type(exc).__name__}: {exc}); "
                          "fix or regenerate it") from None


def pruned_layout(config: ModelConfig, pruned: dict) -> ModelConfig:
    """transformers 4.x's `pruned_heads` {layer: original head indices} as the layout lmkit's pruning records (the
    model then saves in lmkit's format: transformers 5 reads no `pruned_heads`)."""
    if config.architecture == "encoder-decoder" or (config.n_kv_heads or config.n_heads) != config.n_heads:
        raise ConfigError("pruned_heads is read for BERT, RoBERTa, DistilBERT and GPT-2 folders only")
    stack = "encoder" if config.architecture == "encoder" else "decoder"
    layout, record = {}, {}
    for layer, heads in pruned.items():
        gone = sorted({int(h) for h in heads})
        if not 0 <= int(layer) < config.n_layers or any(not 0 <= h < config.n_heads for h in gone):
            raise ConfigError(f"pruned_heads {{{layer!r}: {heads}}} names a layer or head this model "
                              f"({config.n_layers} layers of {config.n_heads} heads) does not have")
        if gone:
            name = f"{stack}.layers.{int(layer)}.self_attn.sublayer"
            layout[name] = [config.n_heads - len(gone)] * 2
            record[name] = gone
    compression = dataclasses.replace(config.compression, attention_heads=layout, pruned_heads=record)
    return config.replace(compression=compression, family=None)


def load_model(path: str | Path, dtype: torch.dtype | str | None = None, device: str | torch.device | None = None):
    """A model in eval mode from a Hugging Face format folder: float32 unless dtype is given (a torch dtype, its
    name such as "bfloat16", or "auto" for config.json's dtype / torch_dtype, as transformers takes them), on the
    CPU unless device is given ("auto", "cpu", "cuda", "cuda:1", "mps" or a torch.device: lmkit.device)."""
    target = None if device is None else resolve_device(device, "device=")  # refused before any file is read
    folder = Path(path)
    config, raw = load_config(folder)
    dtype = _resolve_dtype(dtype, raw)
    family = None if "lmkit" in raw and "model_type" not in raw else family_of(raw.get("model_type"))
    hf = read_weights(folder)
    # a decoder checkpoint with a task head's tensors: loading the rest as a language model would silently drop it
    head = next((k for k in DECODER_HEAD_TENSORS if k in hf), None) \
        if config.architecture == "decoder" and config.position != "xl" else None  # causal XLNet has its heads
    if head is not None and family is not None:
        raise ConfigError(f"{folder} holds {head}, the tensor of a task head (classification, question answering, "
                          f"multiple choice) that lmkit's {raw.get('model_type')} language model lacks; load a folder "
                          "of the language-model class")
    if target is not None and target.type != "cpu" and config.compression.get("quantization"):
        raise ConfigError(f"{folder} holds an int8 model (`lmkit quantize`), whose dynamic int8 layers run on the CPU "
                          f"only; load it with device='cpu', or load the float model it was made from on {target}")
    hooks = folder_hooks(config)
    kept = {}  # what each hook's restore needs (the int8 values of quantized layers)
    for hook in hooks:
        if hook.read is not None:
            hf, kept[hook.key] = hook.read(hf, config, dtype, folder)
    _check_weights_fit(config, family, raw, hf, folder)
    if family is not None and family.prepare_weights is not None:  # e.g. fused expert tensors split per expert
        hf = family.prepare_weights(hf)
    model, state = _model_and_state(config, family, raw, hf, folder)
    if _head_stored_apart(model.config, family, hf):  # the built model's config names its head (encoders)
        # transformers 5 leaves the head untied when a checkpoint stores it and the embeddings with other values
        untied = _model_and_state(model.config.replace(tie_embeddings=False), family, raw, hf, folder)
        if _differ(untied[1], _tied_names(model)):
            model, state = untied
    expected = model.state_dict()
    tied = {k for k in expected if k not in state}
    result = model.load_state_dict(state, strict=False)
    really_missing = [k for k in result.missing_keys if k in tied and not _is_tied(model, k)]
    if really_missing:
        raise CheckpointError(f"{folder} lacks tensors {', '.join(really_missing[:5])}")
    model = model.to(dtype) if dtype is not None else model.float()
    for hook in hooks:
        if hook.restore is not None:
            model = hook.restore(model, kept.get(hook.key))
    model.generation_defaults = generation_defaults(folder)
    return (model if target is None else model.to(target)).eval()


def load_skeleton(path: str | Path, dtype: torch.dtype | None = None):
    """The model a folder describes on the meta device: its config, module shapes, dtype and generation defaults,
    no weights (a server process that only checks requests, while another process holds the weights)."""
    folder = Path(path)
    config, raw = load_config(folder)
    family = None if "lmkit" in raw and "model_type" not in raw else family_of(raw.get("model_type"))
    with torch.device("meta"):
        model = _build(config, family, raw, {})
        for hook in folder_hooks(config):
            if hook.build is not None:
                hook.build(model)
    model = model.to(dtype) if dtype is not None else model
    model.generation_defaults = generation_defaults(folder)
    return model.eval()


def _model_and_state(config: ModelConfig, family, raw: dict, hf: dict[str, torch.Tensor], folder: Path):
    """The model config.json describes (pruned heads laid out) and its state dict read from the checkpoint."""
    model = _build(config, family, raw, hf)
    for hook in folder_hooks(config):  # e.g. a model whose heads were pruned: per-layer head counts
        if hook.build is not None:
            hook.build(model)
    expected = model.state_dict()
    if family is None:
        state = {k: hf[k] for k in expected if k in hf}
        missing = sorted(k for k in set(expected) - set(state) if not _is_tied(model, k))  # tied: stored once
        if missing:
            raise CheckpointError(f"{folder} lacks tensors {', '.join(missing[:5])}; the folder is incomplete")
        return model, state
    return model, from_hf(hf, family.rules(model.config), expected, family.aliases, source=str(folder))


def _head_stored_apart(config: ModelConfig, family, hf: dict[str, torch.Tensor]) -> bool:
    """True when config.json ties the head to the token table but the checkpoint also holds the head's own tensor."""
    if family is None or not config.tie_embeddings:
        return False
    tied = {rule.hf for rule in family.rules(config)}
    return any(rule.hf in hf and rule.hf not in tied for rule in family.rules(config.replace(tie_embeddings=False)))


def _tied_names(model) -> list[str]:
    """The parameter names that share the token table (its embeddings, the tied head)."""
    table = model.get_input_embeddings().weight
    return [k for k, p in model.named_parameters(remove_duplicate=False) if p is table]


def _differ(state: dict[str, torch.Tensor], names: list[str]) -> bool:
    """True when the tensors `state` holds under `names` are not all equal."""
    names = [k for k in names if k in state]
    first = state[names[0]]
    return any(state[k].shape != first.shape or not torch.equal(state[k], first) for k in names[1:])


def _build(config: ModelConfig, family, raw: dict, hf: dict[str, torch.Tensor]):
    """The model config.json describes; a family's `build` also sees the tensor names (optional modules)."""
    if family is None or family.build is None:
        return build_model(config)
    return family.build(config, raw, hf.keys())


def _check_weights_fit(config: ModelConfig, family, raw: dict, hf: dict[str, torch.Tensor], folder: Path) -> None:
    """Refuse, before allocating anything, a config.json that asks for far more parameters than the weights hold
    (a bare {"model_type": "llama"} would otherwise build transformers' 7B defaults and exhaust memory)."""
    try:
        with torch.device("meta"):
            needed = sum(p.numel() for p in _build(config, family, raw, hf).parameters())
    except Exception:  # a family that cannot be built on the meta device: the shape checks later still apply
        return
    stored = sum(t.numel() for t in hf.values())
    if needed > 4 * stored + 10_000_000:
        raise CheckpointError(f"{folder / 'config.json'} describes a model of {needed:,} parameters but the weights "
                              f"hold {stored:,} values: config.json does not belong to these weights (fields missing "
                              f"or wrong); restore the config.json saved with them")


def _resolve_dtype(dtype: torch.dtype | str | None, raw: dict) -> torch.dtype | None:
    if dtype == "auto":
        dtype = raw.get("dtype") or raw.get("torch_dtype") or "float32"
    if isinstance(dtype, str):
        resolved = getattr(torch, dtype.removeprefix("torch."), None)
        if not isinstance(resolved, torch.dtype) or not resolved.is_floating_point:
            raise ConfigError(f"dtype {dtype!r} is not a floating-point torch dtype; pass e.g. torch.bfloat16, "
                              f"'float16' or 'auto' (the dtype config.json names)")
        dtype = resolved
    return dtype


# generation_config.json keys that `generate` takes as defaults, as transformers does when they are unset
GENERATION_DEFAULT_KEYS = GenerationConfig.file_keys()


def generation_defaults(folder: Path) -> dict:
    """The generate defaults of a folder: its generation_config.json, or without one (folders of transformers 4,
    hand-written ones) the same keys of config.json, where transformers then reads them."""
    path = Path(folder) / "generation_config.json"
    if not path.is_file():
        path = Path(folder) / "config.json"
    raw = read_json(path)
    return {k: raw[k] for k in GENERATION_DEFAULT_KEYS if raw.get(k) is not None}


def _is_tied(model, key: str) -> bool:
    """True when the parameter behind `key` is the same tensor as another one that was loaded."""
    params = dict(model.named_parameters(remove_duplicate=False))
    if key not in params:
        return True  # a buffer that is rebuilt at construction (rotary tables, sinusoids)
    target = params[key]
    return any(p is target and k != key for k, p in params.items())


def check_savable(model) -> tuple[Family | None, dict | None]:
    """(family, its config.json) that save_pretrained writes; a ConfigError if the format cannot hold the model.

    Writes nothing, so a trainer can refuse a model before its first step rather than at its first save.
    """
    config = model.config
    family = _families().get(config.family) if config.family else None
    if family is None:
        return None, None
    if config.sliding_window and not family.sliding_window:
        raise ConfigError(f"the {config.family} format has no sliding window (sliding_window={config.sliding_window}); "
                          "save with family='mistral', 'qwen2', 'mixtral' or None")
    if config.sliding_window and config.sliding_layers is not None and not family.sliding_layers:
        raise ConfigError(f"the {config.family} format slides every layer or none, and this model slides layers "
                          f"{config.sliding_layers} only; save with family='qwen2' or None")
    if config.n_experts and not family.experts:
        raise ConfigError(f"the {config.family} format has no mixture of experts (n_experts={config.n_experts}); "
                          "save a decoder with family='mixtral', or any model with family=None")
    if config.attention_scale_by_layer and not family.scale_by_layer:
        raise ConfigError(f"the {config.family} format cannot scale layer i's attention scores by 1/(i + 1) "
                          "(attention_scale_by_layer); save with family='gpt2' or None")
    # the family's own config check says in one line why a model does not fit, before a weight name is missing
    return family, family.config_to_hf(config)


def save_pretrained(model, path: str | Path, max_shard_bytes: int | None = None) -> None:
    """config.json + model.safetensors in the format of the model's family (lmkit's own if it has none)."""
    family, raw = check_savable(model)
    folder = Path(path)
    folder.mkdir(parents=True, exist_ok=True)
    config = model.config
    state = {k: v for k, v in model.state_dict().items()}
    if family is None:
        tensors = _untie(model, state)
        for hook in folder_hooks(config):  # int8 layers hold no parameters: their tensors come from their hook
            if hook.tensors is not None:
                tensors.update(hook.tensors(model))
        raw = {"lmkit": config.to_dict(), "architectures": [type(model).__name__]}
    else:
        tensors = to_hf(state, family.rules(config))
        raw["torch_dtype"] = raw["dtype"] = str(next(iter(tensors.values())).dtype).removeprefix("torch.")
    raw.setdefault("transformers_version", "4.46.0")
    write_weights(folder, tensors, max_shard_bytes)
    atomic_write_json(folder / "config.json", raw, sort_keys=True)
    if getattr(model, "generation_defaults", None):
        atomic_write_json(folder / "generation_config.json", dict(model.generation_defaults), sort_keys=True)


def _untie(model, state: dict[str, torch.Tensor]) -> dict[str, torch.Tensor]:
    """Drop the second name of each tied parameter (safetensors stores a tensor once)."""
    seen, out = set(), {}
    for name, p in model.named_parameters(remove_duplicate=False):
        if id(p) in seen:
            continue
        seen.add(id(p))
        out[name] = state[name]
    for name, buf in model.named_buffers():
        if name in state:
            out[name] = state[name]
    return out


register_folder_writer(save_pretrained)
