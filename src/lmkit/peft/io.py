"""Adapters on disk in the PEFT library's folder format: adapter_config.json + adapter_model.safetensors.

Tensor names are the Hugging Face names of the family (`base_model.model.model.layers.0.self_attn.q_proj
.lora_A.weight`), so the PEFT library loads a LoRA, IA3 or prompt-tuning adapter saved here onto the
transformers model, and lmkit loads theirs. Where HF fuses several lmkit layers (GPT-2's c_attn = q, k, v),
parts sharing one A (the fused layer targeted) save as A, B = [B_q; B_k; B_v]; parts with their own A join
exactly as A = [A_q; A_k; A_v], B = blockdiag(B_q, B_k, B_v) (rank 3r, alpha 3 alpha). Loading gives every
part the one A (shared) and its rows of B. Prefix tuning and bottleneck adapters have no PEFT
counterpart with lmkit's layout; they are written in the same folder format with lmkit's names.
"""
from __future__ import annotations

import re
from pathlib import Path

import torch
from torch import nn

from lmkit.errors import CheckpointError, ConfigError
from lmkit.hub.convert import from_hf, rename
from lmkit.hub.files import load_safetensors, read_json
from lmkit.peft import adapters, lora, prompt, quant
from lmkit.peft.model import PeftConfig, PeftModel, mark_trainable, untie_saved
from lmkit.peft.names import hf_rules, matches, replace_module
# save_adapter is importable from here too, beside load_adapter
from lmkit.peft.save import CONFIG, PEFT_TYPES, PREFIX, WEIGHTS, full_tensor_prefix, module_groups, save_adapter  # noqa: F401

# LoraConfig fields whose non-default values change the math in ways lmkit does not reproduce
LORA_UNSUPPORTED = {
    "use_dora": "DoRA (use_dora)", "lora_bias": "a bias on lora_B (lora_bias)",
    "layer_replication": "layer replication (layer_replication)", "target_parameters": "LoRA on parameters "
    "(target_parameters)", "trainable_token_indices": "trainable tokens (trainable_token_indices)",
    "alora_invocation_tokens": "activated LoRA (alora_invocation_tokens)", "use_qalora": "QALoRA (use_qalora)",
    "use_bdlora": "block-diagonal LoRA (use_bdlora)", "arrow_config": "Arrow routing (arrow_config)",
    "megatron_config": "Megatron parallel layers (megatron_config)", "velora_config": "VeLoRA (velora_config)",
    "monteclora_config": "MonteCLoRA (monteclora_config)", "kasa_config": "KaSA (kasa_config), which also "
    "truncates the base weights",
}
# init_lora_weights that rewrite the base weights (the adapter only fits the changed base)
BASE_CHANGING_INITS = ("pissa", "corda", "olora", "loftq", "lora_ga")


def load_adapter(model: nn.Module, path, trainable: bool = False) -> PeftModel:
    """Add the adapter of a PEFT-format folder to `model` (in place) and return the PeftModel."""
    folder = Path(path)
    for name in (CONFIG, WEIGHTS):
        if not (folder / name).is_file():
            raise CheckpointError(f"{folder / name} is missing; an adapter folder holds {CONFIG} and {WEIGHTS}")
    raw = read_json(folder / CONFIG)
    tensors = load_safetensors(folder / WEIGHTS)
    ours = dict(raw.get("lmkit") or {})
    kind = raw.get("peft_type")
    method = {v: k for k, v in reversed(PEFT_TYPES.items())}.get(kind)  # LORA -> lora
    if method is None:
        raise ConfigError(f"adapter type {kind!r} is not supported; lmkit loads {', '.join(sorted(set(PEFT_TYPES.values())))}")
    if method == "lora" and ours.get("method") == "qlora":
        method = "qlora"
    config = PeftConfig(**{**ours, "method": method})
    untie_saved(model, raw.get("modules_to_save") or config.modules_to_save)
    if method in ("lora", "qlora", "ia3", "prompt"):
        _check_supported(raw, tensors, method)
        # tensors trained in full (modules_to_save, biases with bias="all"/"lora_only"), on the unwrapped model
        adapter_keys = {"lora": (".lora_A.", ".lora_B."), "qlora": (".lora_A.", ".lora_B."), "ia3": (".ia3_l",),
                        "prompt": ("prompt_embeddings",)}[method]
        _load_full(model, {k: v for k, v in tensors.items() if not any(a in k for a in adapter_keys)}, folder,
                   full_tensor_prefix(method))
    if method in ("lora", "qlora"):
        if method == "qlora":
            quant.quantize_linears(model, config.bits, config.block_size, skip=("lm_head", *config.modules_to_save),
                                   double_quant=config.double_quant)
        targets = _load_lora(model, raw, tensors, config)
    elif method == "ia3":
        targets = _load_ia3(model, raw, tensors)
    elif method == "prompt":
        targets = prompt.apply_prompt(model, int(raw["num_virtual_tokens"]))
        config.num_virtual_tokens = int(raw["num_virtual_tokens"])
        emb = next(m for m in model.modules() if isinstance(m, prompt.PromptEmbedding))
        _copy(model, {n: tensors["prompt_embeddings"] for n, p in model.named_parameters()
                      if p is emb.prompt_embeddings}, folder)
    else:
        targets = (prompt.apply_prefix(model, config.num_virtual_tokens) if method == "prefix"
                   else adapters.apply_adapters(model, config.bottleneck))
        _copy(model, {k: v for k, v in tensors.items() if not k.startswith(PREFIX)}, folder)
    if raw.get("modules_to_save"):
        config.modules_to_save = list(raw["modules_to_save"])
    if method in ("lora", "qlora"):
        config.bias = str(raw.get("bias") or "none")
        PeftConfig(method=method, bias=config.bias)  # refuses an unknown value
    out = PeftModel(model, config, targets=targets)
    mark_trainable(model, config.modules_to_save, config.bias)
    if not trainable:
        for p in out.parameters():
            p.requires_grad_(False)
    return out


def _copy(model: nn.Module, state: dict[str, torch.Tensor], folder: Path) -> None:
    params = dict(model.named_parameters(remove_duplicate=False))
    for name, t in state.items():
        if name not in params or params[name].shape != t.shape:
            raise CheckpointError(f"{folder / WEIGHTS}: tensor {name} {tuple(t.shape)} does not fit this model")
        with torch.no_grad():
            params[name].copy_(t)


def _check_supported(raw: dict, tensors: dict, method: str) -> None:
    """A clear error for settings that change the outputs in ways lmkit does not reproduce."""
    if method in ("lora", "qlora"):
        for key, what in LORA_UNSUPPORTED.items():
            if raw.get(key):
                raise ConfigError(f"this LoRA adapter uses {what}, which lmkit does not support; train a plain LoRA "
                                  "adapter")
        init = raw.get("init_lora_weights")
        if isinstance(init, str) and init.lower().startswith(BASE_CHANGING_INITS):
            raise ConfigError(f"this LoRA adapter was made with init_lora_weights={init!r}, which changes the base "
                              "weights; lmkit cannot load it onto the original model. Convert it to a plain LoRA "
                              "adapter first (PEFT's path_initial_model_for_weight_conversion)")
    if method == "prompt" and int(raw.get("num_transformer_submodules") or 1) != 1:
        raise ConfigError("this prompt-tuning adapter puts virtual tokens in front of the decoder too "
                          "(num_transformer_submodules=2, PEFT's default for SEQ_2_SEQ_LM); lmkit puts them in front "
                          "of the encoder only (num_transformer_submodules=1)")
    for key in tensors:
        if ".lora_embedding_" in key:
            raise ConfigError("LoRA on embedding layers is not supported; target linear layers only")
        if ".trainable_tokens_delta" in key or ".lora_magnitude_vector" in key:
            raise ConfigError(f"adapter tensor {key} belongs to a method lmkit does not support (trainable tokens, "
                              "DoRA)")


def _load_full(model: nn.Module, tensors: dict, folder: Path, prefix: str = PREFIX) -> None:
    """Copy HF-named tensors trained in full into the model, splitting fused ones (GPT-2's c_attn) by the rules."""
    rules = {rule.hf: rule for rule in hf_rules(model)}
    covered = {o for rule in rules.values() for o in rule.ours}
    # not in the family's table (an untied head; a tied one, whose base weight PEFT saves when LoRA targets it
    # and loads into the shared weight): lmkit's name
    for name, _ in model.named_parameters(remove_duplicate=False):
        if name not in covered:
            rules.setdefault(name, rename(name, name))
    wanted: dict[str, torch.Tensor] = {}
    for key, t in tensors.items():
        if ".modules_to_save." in key or ".original_module." in key:
            continue  # PEFT's wrapper copies (bias="all"); the trained one is also saved under the plain name
        hf = key.removeprefix(prefix).replace(".base_layer.", ".")
        if hf not in rules:
            raise CheckpointError(f"{folder / WEIGHTS}: tensor {key} names {hf}, which this model does not have")
        wanted[hf] = t
    params = dict(model.named_parameters(remove_duplicate=False))
    _copy(model, from_hf(wanted, [rules[h] for h in wanted], params, source=str(folder / WEIGHTS)), folder)


def _suffix_lookup(pattern: dict, hf: str, default):
    """PEFT's rank_pattern / alpha_pattern lookup: the first key that, as a regex, matches the name's end."""
    for key, value in (pattern or {}).items():
        if re.match(rf"(.*\.)?({key})$", hf):
            return value
    return default


def _load_lora(model: nn.Module, raw: dict, tensors: dict, config: PeftConfig) -> list[str]:
    config.use_rslora = bool(raw.get("use_rslora"))
    config.r, config.alpha = int(raw.get("r", config.r)), float(raw.get("lora_alpha", config.alpha))
    config.dropout = float(raw.get("lora_dropout", 0.0))
    groups = module_groups(model, (nn.Linear, quant.QuantizedLinear))
    targets = []
    for key in sorted(k for k in tensors if k.endswith(".lora_A.weight")):
        hf = key.removeprefix(PREFIX).removesuffix(".lora_A.weight")
        hf = hf.replace(".base_layer", "")
        if hf not in groups:
            raise CheckpointError(f"adapter tensor {key} names {hf}, which this model does not have")
        A, B = tensors[key], tensors[key.replace(".lora_A.", ".lora_B.")]
        rank = A.shape[0]
        parts = [model.get_submodule(p) for p in groups[hf]]
        want_a, want_b = (rank, parts[0].in_features), (sum(p.out_features for p in parts), rank)
        if tuple(A.shape) != want_a or tuple(B.shape) != want_b:
            raise CheckpointError(f"adapter tensors of {hf}: A {tuple(A.shape)} and B {tuple(B.shape)} do not fit the "
                                  f"layer (A {want_a}, B {want_b}); the adapter was made for another model")
        alpha = float(_suffix_lookup(raw.get("alpha_pattern"), hf, config.alpha))
        row, shared = 0, None
        for part in groups[hf]:   # the parts of a fused layer share its A (one LoRA, as in PEFT)
            base = model.get_submodule(part)
            layer = lora.LoRALinear(base, rank, alpha, config.dropout, config.use_rslora, lora_A=shared)
            shared = layer.lora_A
            with torch.no_grad():
                layer.lora_A.weight.copy_(A)
                layer.lora_B.weight.copy_(B[row:row + base.out_features])
            row += base.out_features
            replace_module(model, part, layer)
            targets.append(part)
    return targets


def _load_ia3(model: nn.Module, raw: dict, tensors: dict) -> list[str]:
    groups = module_groups(model, (nn.Linear, quant.QuantizedLinear))
    ff_patterns = raw.get("feedforward_modules") or []
    ff_patterns = ["re:" + ff_patterns] if isinstance(ff_patterns, str) else ff_patterns
    targets = []
    for key in sorted(k for k in tensors if k.endswith(".ia3_l")):
        hf = key.removeprefix(PREFIX).removesuffix(".ia3_l").replace(".base_layer", "")
        if hf not in groups:
            raise CheckpointError(f"adapter tensor {key} names {hf}, which this model does not have")
        vec, row = tensors[key], 0
        # PEFT stores a feed-forward (input) scale as (1, in) and an output scale as (out, 1): the shape says which
        # (its feedforward_modules test is a bare `endswith`, `proj` taking in down_proj, unlike lmkit's patterns)
        ff = vec.shape[0] == 1 if vec.dim() == 2 and vec.shape != (1, 1) else matches(hf, ff_patterns)
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


def lora_weights(model: nn.Module, path) -> dict[str, tuple[torch.Tensor, torch.Tensor, float]]:
    """The LoRA of a PEFT-format folder as {module name of `model`: (A, B, scaling)}, `model` left as it is: what a
    server applying adapters per request (`generation.lora_rows`) takes. Adapters that change more than their
    low-rank updates (modules trained in full, biases, QLoRA's quantized base, other methods) are refused."""
    import copy

    peft = load_adapter(copy.deepcopy(model), path)
    config = peft.peft_config
    if config.method != "lora" or config.modules_to_save or config.bias != "none":
        raise ConfigError(f"{path}: only a plain LoRA adapter (no modules_to_save, bias 'none') applies per request; "
                          f"this one is {config.method} with modules_to_save={config.modules_to_save} and bias "
                          f"{config.bias!r}: merge it into the model and serve that folder")
    return {name: (m.lora_A.weight.detach(), m.lora_B.weight.detach(), m.scaling)
            for name, m in lora.lora_layers(peft.base_model).items()}
