"""Mistral (MistralForCausalLM): LLaMA without biases, plus one causal sliding window for every layer.

config.json's `sliding_window` (transformers' default 4096 when the key is absent, null for none) is
read and written; `head_dim` may differ from hidden_size / num_attention_heads. Weights are LLaMA's names.
"""
from __future__ import annotations

from lmkit.config import ModelConfig
from lmkit.hub import llama
from lmkit.hub.convert import Rule
from lmkit.hub.family import Family

ALIASES = llama.ALIASES
DEFAULTS = {"intermediate_size": 14336, "num_key_value_heads": 8, "max_position_embeddings": 131072,
            "bos_token_id": 1, "eos_token_id": 2}  # MistralConfig's, where LlamaConfig's differ


def config_from_hf(hf: dict) -> ModelConfig:
    return llama.config_from_hf({**DEFAULTS, **hf}, family="mistral", attention_bias=False, mlp_bias=False,
                                sliding_window=hf.get("sliding_window", 4096))


def config_to_hf(cfg: ModelConfig) -> dict:
    llama.check_biases(cfg, "Mistral")
    return {**llama.llama_like_to_hf(cfg, "mistral", "MistralForCausalLM"), "sliding_window": cfg.sliding_window}


def rules(cfg: ModelConfig) -> list[Rule]:
    """lmkit CausalLM names -> MistralForCausalLM names (LLaMA's)."""
    return llama.rules(cfg)


FAMILY = Family(model_types=("mistral",), hf_classes=("MistralForCausalLM", "MistralModel"),
                config_from_hf=config_from_hf, config_to_hf=config_to_hf, rules=rules, aliases=ALIASES,
                sliding_window=True)  # config.json's sliding_window is read and written
