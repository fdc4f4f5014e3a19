"""Qwen2 (Qwen2ForCausalLM): LLaMA with biases on the q/k/v projections (none on o_proj or the FFN).

Sliding windows: transformers slides layer i over `sliding_window` positions when `use_sliding_window`
and i >= `max_window_layers` (4.x), or as the `layer_types` list says (5.x, and 4.x since it has one; the
list wins). lmkit reads either into sliding_window + sliding_layers, and writes both: `layer_types`, and
`max_window_layers` = the first sliding layer (exact for 4.x readers when the sliding layers are the last ones).
Settings that say the same model otherwise (a window no layer uses, max_window_layers without a window) are
kept in extra["qwen2_sliding"] and written back as config.json had them.
"""
from __future__ import annotations

from lmkit.config import ModelConfig, sliding_fields
from lmkit.errors import ConfigError
from lmkit.hub import llama
from lmkit.hub.convert import Rule
from lmkit.hub.family import Family

ALIASES = llama.ALIASES
DEFAULTS = {"vocab_size": 151936, "intermediate_size": 22016, "num_key_value_heads": 32,
            "max_position_embeddings": 32768}  # Qwen2Config's, where LlamaConfig's differ
LAYER_TYPES = ("full_attention", "sliding_attention")
KEPT = ("use_sliding_window", "sliding_window", "max_window_layers")


def sliding_from_hf(hf: dict) -> dict:
    """sliding_window and sliding_layers as transformers' Qwen2Config reads them from config.json."""
    n = hf.get("num_hidden_layers", 32)
    window = hf.get("sliding_window", 4096) if hf.get("use_sliding_window", False) else None
    types = hf.get("layer_types")
    if types is None:
        first = hf.get("max_window_layers", 28)
        types = ["sliding_attention" if i >= first else "full_attention" for i in range(n)]
    if not isinstance(types, list) or len(types) != n or any(t not in LAYER_TYPES for t in types):
        raise ConfigError(f"layer_types must list {n} entries, each one of {', '.join(LAYER_TYPES)}")
    return sliding_fields(window, [t == "sliding_attention" for t in types])


def config_from_hf(hf: dict) -> ModelConfig:
    hf = {**DEFAULTS, **hf}
    sliding = sliding_from_hf(hf)
    # config.json's window settings as transformers reads them, where they differ from those lmkit writes for the
    # model (a window no layer uses, max_window_layers without a window): written back while they describe it
    use = bool(hf.get("use_sliding_window", False))
    read = {"use_sliding_window": use, "sliding_window": hf.get("sliding_window", 4096) if use else None,
            "max_window_layers": hf.get("max_window_layers", 28)}
    written = window_settings(sliding["sliding_window"], sliding["sliding_layers"], hf.get("num_hidden_layers", 32))
    kept = {k: v for k, v in read.items() if v != written[k]}
    return llama.config_from_hf(hf, family="qwen2", attention_bias=True, attention_out_bias=False, mlp_bias=False,
                                **sliding, extra={"qwen2_sliding": kept} if kept else {})


def window_settings(window: int | None, layers: list[int] | None, n_layers: int) -> dict:
    """use_sliding_window, sliding_window and max_window_layers lmkit writes for these sliding layers."""
    first = (layers[0] if layers else 0) if window else n_layers
    return {"use_sliding_window": window is not None, "sliding_window": window, "max_window_layers": first}


def config_to_hf(cfg: ModelConfig) -> dict:
    llama.check_biases(cfg, "Qwen2", qkv=True)
    slides = [cfg.layer_window(i) is not None for i in range(cfg.n_layers)]
    window = cfg.sliding_window if any(slides) else None
    out = {**llama.llama_like_to_hf(cfg, "qwen2", "Qwen2ForCausalLM"),
           **window_settings(window, [i for i, s in enumerate(slides) if s], cfg.n_layers),
           "layer_types": ["sliding_attention" if s else "full_attention" for s in slides]}
    kept = {k: v for k, v in cfg.extra.get("qwen2_sliding", {}).items() if k in KEPT}
    model = sliding_fields(window, slides)
    if kept and sliding_from_hf({**out, **kept}) == model:  # as transformers reads them (layer_types wins)
        out.update(kept)
    return out


def rules(cfg: ModelConfig) -> list[Rule]:
    """lmkit CausalLM names -> Qwen2ForCausalLM names (LLaMA's, with q/k/v biases)."""
    return llama.rules(cfg)


FAMILY = Family(model_types=("qwen2",), hf_classes=("Qwen2ForCausalLM", "Qwen2Model"), config_from_hf=config_from_hf,
                config_to_hf=config_to_hf, rules=rules, aliases=ALIASES,
                # written as use_sliding_window, sliding_window, max_window_layers and layer_types
                sliding_window=True, sliding_layers=True)
