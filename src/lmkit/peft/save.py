"""Writing an adapter (and the modules trained in full) as a PEFT-format folder: adapter_config.json +
adapter_model.safetensors under Hugging Face names; the format, and reading it back, in `lmkit.peft.io`."""
from __future__ import annotations

import itertools
import math
from pathlib import Path
from typing import TYPE_CHECKING

import torch
from torch import nn

from lmkit.atomic import atomic_write_json
from lmkit.errors import ConfigError
from lmkit.hub.files import atomic_save_safetensors
from lmkit.peft import adapters, lora, prompt
from lmkit.peft.names import ADAPTER_PARAMS, hf_groups, hf_rules

if TYPE_CHECKING:
    from lmkit.peft.model import PeftModel

CONFIG, WEIGHTS = "adapter_config.json", "adapter_model.safetensors"
PREFIX = "base_model.model."
PEFT_TYPES = {"lora": "LORA", "qlora": "LORA", "ia3": "IA3", "prompt": "PROMPT_TUNING",
              "prefix": "LMKIT_PREFIX_TUNING", "adapter": "LMKIT_BOTTLENECK_ADAPTER"}



def module_groups(model: nn.Module, kinds) -> dict[str, list[str]]:
    """HF module -> lmkit parts, for the modules of the given kinds (identity names without a family)."""
    groups = hf_groups(model)
    covered = {p for parts in groups.values() for p in parts}
    # a layer outside the family's table (a head tied to the embedding, which HF also calls lm_head): lmkit's name
    return {**groups, **{n: [n] for n, m in model.named_modules() if isinstance(m, kinds) and n not in covered}}


def _task_type(model: nn.Module, saves_head: bool) -> str | None:
    kind = type(model).__name__
    if kind == "Encoder":  # PEFT's task of the head (prompt tuning acts only through a task's model class); PEFT
        # then expects the head's tensors in the adapter. Any other encoder is FEATURE_EXTRACTION, whose PEFT
        # model still puts the virtual tokens in front (with no task type PEFT would silently leave them out; it
        # does drop token_type_ids there, with a warning, where lmkit keeps them)
        task = {"sequence": "SEQ_CLS", "token": "TOKEN_CLS", "qa": "QUESTION_ANS"}.get(getattr(model, "head", None))
        return task if saves_head and task else "FEATURE_EXTRACTION"
    return {"CausalLM": "CAUSAL_LM", "Seq2SeqLM": "SEQ_2_SEQ_LM"}.get(kind)


def full_tensor_prefix(method: str) -> str:
    """PEFT names prompt-learning tensors trained in full `base_model.X`, the others `base_model.model.X`."""
    return "base_model." if method == "prompt" else PREFIX


def save_adapter(peft_model: PeftModel, path) -> None:
    """Write the adapter alone (and any modules trained in full) as a PEFT-format folder."""
    model, c = peft_model.base_model, peft_model.peft_config
    folder = Path(path)
    tensors: dict[str, torch.Tensor] = {}
    raw = {"peft_type": PEFT_TYPES[c.method], "task_type": _task_type(model, bool(c.modules_to_save)),
           "base_model_name_or_path": None, "inference_mode": True, "revision": None}
    if c.method in ("qlora", "prefix", "adapter"):  # what the PEFT fields cannot say (PEFT ignores it, with a warning)
        raw["lmkit"] = c.to_dict()
    if c.method in ("lora", "qlora"):
        targets, ranks, alphas = [], {}, {}
        layers = lora.lora_layers(model)
        for hf, parts in module_groups(model, lora.LoRALinear).items():
            mods = [model.get_submodule(p) for p in parts]
            if not any(isinstance(m, lora.LoRALinear) for m in mods):
                continue
            adapted = [m for m in mods if isinstance(m, lora.LoRALinear)]
            if len({m.scaling for m in adapted}) > 1:
                raise ConfigError(f"LoRA layers fused into {hf} have different alpha/r; give them one alpha/r")
            owners = list({id(m.lora_A): m.lora_A for m in adapted}.values())   # parts may share one A
            A = torch.cat([a.weight for a in owners], dim=0)
            rank = A.shape[0]
            cols = dict(zip(map(id, owners), itertools.accumulate([0] + [a.out_features for a in owners])))
            B = A.new_zeros(sum(m.out_features for m in mods), rank)
            row = 0
            for m in mods:
                if isinstance(m, lora.LoRALinear):
                    col = cols[id(m.lora_A)]
                    B[row:row + m.out_features, col:col + m.r] = m.lora_B.weight
                row += m.out_features
            tensors[f"{PREFIX}{hf}.lora_A.weight"] = A
            tensors[f"{PREFIX}{hf}.lora_B.weight"] = B
            targets.append(hf)
            alpha = adapted[0].scaling * (math.sqrt(rank) if c.use_rslora else rank)  # PEFT's alpha giving this scale
            if rank != c.r or not math.isclose(alpha, c.alpha, rel_tol=1e-6):
                ranks[hf], alphas[hf] = rank, alpha
        if not layers:
            raise ConfigError("this model has no LoRA layers to save")
        raw.update(r=c.r, lora_alpha=c.alpha, lora_dropout=c.dropout, target_modules=sorted(targets), bias=c.bias,
                   fan_in_fan_out=getattr(model.config, "family", None) == "gpt2", rank_pattern=ranks,
                   alpha_pattern=alphas, use_rslora=c.use_rslora, use_dora=False, init_lora_weights=True,
                   layers_to_transform=None, layers_pattern=None)
    elif c.method == "ia3":
        targets, ff = [], []
        for hf, parts in module_groups(model, adapters.IA3Linear).items():
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
                   num_transformer_submodules=1,  # virtual tokens in front of the encoder only
                   num_attention_heads=model.config.n_heads, num_layers=model.config.n_layers,
                   prompt_tuning_init="RANDOM")
    else:
        for name, p in model.named_parameters():
            if any(f".{a}" in f".{name}" for a in ADAPTER_PARAMS):
                tensors[name] = p.detach()
    # tensors trained in full (modules_to_save, biases): HF names, `.base_layer.` inside a LoRA layer as in PEFT
    full = {n.replace(".base_layer.", "."): (n, p) for n, p in model.named_parameters(remove_duplicate=False)
            if p.requires_grad and not any(f".{a}" in f".{n}" for a in ADAPTER_PARAMS)}
    for rule in hf_rules(model):
        if rule.ours and all(o in full for o in rule.ours):
            wrapped = any(full[o][0] != o for o in rule.ours)
            t = torch.cat([full.pop(o)[1].detach() for o in rule.ours], dim=0)
            module, _, attr = rule.hf.rpartition(".")
            tensors[full_tensor_prefix(c.method) + (f"{module}.base_layer.{attr}" if wrapped else rule.hf)] = \
                t.t() if rule.transpose else t
    for name, p in full.values():  # not in the family's table: lmkit's name
        tensors[full_tensor_prefix(c.method) + name] = p.detach()
    if c.modules_to_save:
        raw["modules_to_save"] = list(c.modules_to_save)
    folder.mkdir(parents=True, exist_ok=True)
    atomic_save_safetensors({k: v.contiguous() for k, v in tensors.items()}, folder / WEIGHTS)
    atomic_write_json(folder / CONFIG, raw, sort_keys=True)
