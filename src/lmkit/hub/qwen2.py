"""Qwen2 (Qwen2ForCausalLM): LLaMA with biases on the q/k/v projections (none on o_proj or the FFN).

Sliding windows: transformers slides layer i over `sliding_window` positions when `use_sliding_window`
and i >= `max_window_layers` (or as a 5.x `layer_types` list says). lmkit has one window for every layer
or none, so a config that mixes windowed and full layers is refused rather than computed otherwise.
"""
from __future__ import annotations

from lmkit.config import ModelConfig
from lmkit.errors import ConfigError
from lmkit.hub import llama
from lmkit.hub.convert import Rule

MODEL_TYPES = ("qwen2",)
SLIDING_WINDOW = True  # written as use_sliding_window with max_window_layers 0
ALIASES = llama.ALIASES
IGNORED_SUFFIXES = llama.IGNORED_SUFFIXES
DEFAULTS = {"vocab_size": 151936, "intermediate_size": 22016, "num_key_value_heads": 32,
            "max_position_embeddings": 32768}  # Qwen2Config's, where LlamaConfig's differ
LAYER_TYPES = ("full_attention", "sliding_attention")


def sliding_window_from_hf(hf: dict) -> int | None:
    """The window every layer slides over, None when none does; ConfigError when only some layers do."""
    n = hf.get("num_hidden_layers", 32)
    window = hf.get("sliding_window", 4096) if hf.get("use_sliding_window", False) else None
    types = hf.get("layer_types")
    if types is None:
        first = hf.get("max_window_layers", 28)
        types = ["sliding_attention" if i >= first else "full_attention" for i in range(n)]
    if not isinstance(types, list) or len(types) != n or any(t not in LAYER_TYPES for t in types):
        raise ConfigError(f"layer_types must list {n} entries, each one of {', '.join(LAYER_TYPES)}")
    if window is None or "sliding_attention" not in types:
        return None
    if "full_attention" in types:
        sliding = [i for i, t in enumerate(types) if t == "sliding_attention"]
        raise ConfigError(f"layers {sliding[0]}..{sliding[-1]} of {n} slide over {window} positions and the others "
                          "attend to all; lmkit applies one window to every layer or to none, so it cannot run this "
                          "model exactly (use transformers, or set use_sliding_window false if the model was "
                          "trained without windows)")
    return window


def config_from_hf(hf: dict) -> ModelConfig:
    return llama.config_from_hf({**DEFAULTS, **hf}, family="qwen2", attention_bias=True, attention_out_bias=False,
                                mlp_bias=False, sliding_window=sliding_window_from_hf({**DEFAULTS, **hf}))


def config_to_hf(cfg: ModelConfig) -> dict:
    llama.check_biases(cfg, "Qwen2", qkv=True)
    window = cfg.sliding_window
    return {**llama.llama_like_to_hf(cfg, "qwen2", "Qwen2ForCausalLM"), "use_sliding_window": window is not None,
            "sliding_window": window, "max_window_layers": 0 if window else cfg.n_layers,
            "layer_types": ["sliding_attention" if window else "full_attention"] * cfg.n_layers}


def rules(cfg: ModelConfig) -> list[Rule]:
    """lmkit CausalLM names -> Qwen2ForCausalLM names (LLaMA's, with q/k/v biases)."""
    return llama.rules(cfg)
