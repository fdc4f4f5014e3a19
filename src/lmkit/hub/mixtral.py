"""Mixtral (MixtralForCausalLM): LLaMA's attention and config plus a sparse mixture of SwiGLU experts.

Weights load in both layouts: per-expert `block_sparse_moe.experts.{e}.w1/w2/w3` (what transformers
4.x and 5.x write to disk) and the fused 3-D `mlp.experts.gate_up_proj` / `down_proj` of
transformers 5's in-memory modules. Saving writes the per-expert layout, which both read.
w1 = gate_proj, w3 = up_proj, w2 = down_proj; gate_up_proj[e] = cat(w1_e, w3_e) along rows.
"""
from __future__ import annotations

import re

import torch

from lmkit.config import ModelConfig
from lmkit.errors import CheckpointError, ConfigError
from lmkit.hub import llama
from lmkit.hub.convert import Rule
from lmkit.hub.family import Family

ALIASES = (("model.", ""),)


def config_from_hf(hf: dict) -> ModelConfig:
    return llama.config_from_hf(
        {"rope_theta": 1e6, "max_position_embeddings": 32768, **hf}, family="mixtral",
        n_experts=hf.get("num_local_experts", 8), n_experts_per_token=hf.get("num_experts_per_tok", 2),
        router_aux_loss_coef=hf.get("router_aux_loss_coef", 0.001), sliding_window=hf.get("sliding_window"),
        router_jitter_noise=hf.get("router_jitter_noise") or 0.0, output_router_logits=bool(hf.get("output_router_logits")))


def config_to_hf(cfg: ModelConfig) -> dict:
    if not cfg.n_experts:
        raise ConfigError("a Mixtral folder needs experts (n_experts > 0); save a dense model with family='llama'")
    llama.check_biases(cfg, "Mixtral")
    if cfg.expert_capacity_factor is not None:
        raise ConfigError("Mixtral routes without an expert capacity; set expert_capacity_factor=None before saving")
    out = llama.llama_like_to_hf(cfg, "mixtral", "MixtralForCausalLM")
    out.update(num_local_experts=cfg.n_experts,
               num_experts_per_tok=cfg.n_experts_per_token, router_aux_loss_coef=cfg.router_aux_loss_coef,
               output_router_logits=cfg.output_router_logits, sliding_window=cfg.sliding_window,
               router_jitter_noise=cfg.router_jitter_noise)
    return out


def moe_table(cfg: ModelConfig) -> list[tuple]:
    table = [("mlp.sublayer.gate.weight", "block_sparse_moe.gate.weight")]
    for e in range(cfg.n_experts):
        for ours, hf in (("gate_proj", "w1"), ("down_proj", "w2"), ("up_proj", "w3")):
            table.append((f"mlp.sublayer.experts.{e}.{ours}.weight", f"block_sparse_moe.experts.{e}.{hf}.weight"))
    return table


def rules(cfg: ModelConfig) -> list[Rule]:
    """lmkit CausalLM names -> MixtralForCausalLM names (per-expert layout)."""
    return llama.rules(cfg, llama.attention_table(cfg) + moe_table(cfg))


_FUSED = re.compile(r"^(.*layers\.\d+)\.mlp\.(experts\.gate_up_proj|experts\.down_proj|gate\.weight)$")


def prepare_weights(hf: dict[str, torch.Tensor]) -> dict[str, torch.Tensor]:
    """Split transformers 5's fused expert tensors into the per-expert names the rules use."""
    out = {}
    for name, t in hf.items():
        m = _FUSED.match(name)
        if m is None:
            out[name] = t
            continue
        prefix, kind = m.group(1) + ".block_sparse_moe", m.group(2)
        if kind == "gate.weight":
            out[f"{prefix}.gate.weight"] = t
        elif kind == "experts.down_proj":
            for e in range(t.shape[0]):
                out[f"{prefix}.experts.{e}.w2.weight"] = t[e]
        else:
            if t.shape[1] % 2:
                raise CheckpointError(f"{name} has shape {tuple(t.shape)}; gate_up_proj needs an even row count")
            half = t.shape[1] // 2
            for e in range(t.shape[0]):
                out[f"{prefix}.experts.{e}.w1.weight"] = t[e, :half]
                out[f"{prefix}.experts.{e}.w3.weight"] = t[e, half:]
    return out


FAMILY = Family(model_types=("mixtral",), hf_classes=("MixtralForCausalLM", "MixtralModel"),
                config_from_hf=config_from_hf, config_to_hf=config_to_hf, rules=rules, aliases=ALIASES,
                prepare_weights=prepare_weights, sliding_window=True,
                experts=True)  # num_local_experts routed SwiGLU experts
