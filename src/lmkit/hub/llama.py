"""LLaMA (LlamaForCausalLM / LlamaModel), grouped-query attention included: config and weight table.

Reads both config styles: transformers 4.x (`rope_theta`, `rope_scaling`) and 5.x (`rope_parameters`).
"""
from __future__ import annotations

from lmkit.config import ModelConfig
from lmkit.errors import ConfigError
from lmkit.hub.convert import DECODER_HEAD_SUFFIXES, HF_GATED_ACTIVATIONS, Rule, hf_activation, \
    hf_activation_name, layer_rules, refuse_unloadable, rename
from lmkit.hub.family import Family

ALIASES = (("model.", ""),)


def rope_from_hf(hf: dict) -> tuple[float, dict | None]:
    """(theta, scaling) from either the 5.x rope_parameters or the 4.x rope_theta/rope_scaling keys."""
    params = dict(hf.get("rope_parameters") or {})
    theta = float(params.pop("rope_theta", hf.get("rope_theta", 10000.0)))
    partial = params.pop("partial_rotary_factor", hf.get("partial_rotary_factor", 1.0))
    if partial not in (None, 1, 1.0):
        raise ConfigError(f"partial_rotary_factor {partial} (RoPE on part of each head) is not supported; "
                          "lmkit rotates whole heads")
    scaling = params or dict(hf.get("rope_scaling") or {})
    kind = scaling.get("rope_type", scaling.get("type", "default"))
    if kind not in ("default", "linear", "dynamic", "llama3", "yarn"):
        raise ConfigError(f"RoPE scaling {kind!r} is not supported by lmkit (linear, dynamic, llama3 and yarn are)")
    if kind != "default" and scaling.get("factor") is None:
        raise ConfigError(f"RoPE scaling {kind!r} needs a 'factor'; add it to rope_scaling / rope_parameters")
    if kind == "yarn":  # transformers' default for the context YaRN stretches
        scaling.setdefault("original_max_position_embeddings", hf.get("max_position_embeddings", 2048))
    return theta, (scaling if kind != "default" else None)


def rope_to_hf(cfg: ModelConfig) -> dict:
    """Both spellings, so transformers 4.x and 5.x read the same RoPE."""
    scaling = dict(cfg.rope_scaling) if cfg.rope_scaling else None
    if scaling and "rope_type" not in scaling:
        scaling["rope_type"] = {"ntk": "dynamic"}.get(scaling.get("type"), scaling.get("type"))
    params = {"rope_theta": cfg.rope_theta, **(scaling or {"rope_type": "default"})}
    return {"rope_theta": cfg.rope_theta, "rope_scaling": scaling, "rope_parameters": params}


def config_from_hf(hf: dict, family: str = "llama", **overrides) -> ModelConfig:
    """The LLaMA reading of config.json; relatives (Mistral, Qwen2, Mixtral) pass their defaults inside `hf`
    and their own fields (sliding window, biases, experts) as `overrides`."""
    refuse_unloadable(hf, family, "...ForCausalLM", DECODER_HEAD_SUFFIXES)
    act = hf_activation(hf, "hidden_act", "silu", HF_GATED_ACTIVATIONS, family)
    if hf.get("pretraining_tp", 1) not in (1, None):
        raise ConfigError("pretraining_tp > 1 is not supported; set it to 1 (it does not change the weights)")
    theta, scaling = rope_from_hf(hf)
    d, heads = hf.get("hidden_size", 4096), hf.get("num_attention_heads", 32)
    fields = dict(
        family=family, architecture="decoder", vocab_size=hf.get("vocab_size", 32000), d_model=d,
        n_layers=hf.get("num_hidden_layers", 32), n_heads=heads, n_kv_heads=hf.get("num_key_value_heads") or heads,
        head_dim=hf.get("head_dim") or d // heads, d_ff=hf.get("intermediate_size", 11008),
        max_seq_len=hf.get("max_position_embeddings", 2048), position="rope", rope_theta=theta, rope_scaling=scaling,
        norm="rmsnorm", norm_placement="pre", norm_eps=hf.get("rms_norm_eps", 1e-6), norm_bias=False,
        activation=HF_GATED_ACTIVATIONS[act], bias=False, attention_bias=bool(hf.get("attention_bias", False)),
        mlp_bias=bool(hf.get("mlp_bias", False)), tie_embeddings=bool(hf.get("tie_word_embeddings", False)),
        bos_token_id=hf.get("bos_token_id"), eos_token_id=hf.get("eos_token_id"), pad_token_id=hf.get("pad_token_id"),
        attention_dropout=hf.get("attention_dropout", 0.0), init_std=hf.get("initializer_range", 0.02))
    return ModelConfig(**{**fields, **overrides})


def config_to_hf(cfg: ModelConfig) -> dict:
    if cfg.use_attention_out_bias != cfg.use_attention_bias:
        raise ConfigError("LLaMA's attention_bias covers q/k/v and o_proj alike, and this model's o_proj differs; "
                          "save a model with q/k/v biases only with family='qwen2'")
    return {**llama_like_to_hf(cfg, "llama", "LlamaForCausalLM"), "attention_bias": cfg.use_attention_bias,
            "mlp_bias": cfg.use_mlp_bias, "pretraining_tp": 1}


def llama_like_to_hf(cfg: ModelConfig, model_type: str, architecture: str) -> dict:
    """The config.json keys LLaMA shares with its relatives (Mistral, Qwen2, Mixtral): sizes, RoPE in both
    spellings, RMSNorm, the gated activation, tying and special tokens."""
    hidden_act = hf_activation_name(cfg.activation, HF_GATED_ACTIVATIONS, prefer=("gelu_pytorch_tanh",))
    if cfg.position != "rope" or cfg.norm != "rmsnorm" or cfg.norm_placement != "pre" or hidden_act is None \
            or cfg.rope_interleaved or cfg.architecture != "decoder":
        raise ConfigError(f"this model does not fit the {model_type} format (needs RoPE, pre-RMSNorm and a gated "
                          "FFN); save it with family='gpt2' or change the config")
    return {
        "architectures": [architecture], "model_type": model_type, "vocab_size": cfg.vocab_size,
        "hidden_size": cfg.d_model, "intermediate_size": cfg.resolved_d_ff, "num_hidden_layers": cfg.n_layers,
        "num_attention_heads": cfg.n_heads, "num_key_value_heads": cfg.resolved_n_kv_heads, "head_dim": cfg.resolved_head_dim,
        "hidden_act": hidden_act, "max_position_embeddings": cfg.max_seq_len, "rms_norm_eps": cfg.norm_eps,
        "tie_word_embeddings": cfg.tie_embeddings, "bos_token_id": cfg.bos_token_id, "eos_token_id": cfg.eos_token_id,
        "pad_token_id": cfg.pad_token_id, "attention_dropout": cfg.attention_dropout,
        "initializer_range": cfg.init_std, "use_cache": True, **rope_to_hf(cfg),
    }


def check_biases(cfg: ModelConfig, family: str, qkv: bool = False) -> None:
    """Refuse a model whose biases the format cannot hold: none at all, or (qkv) on q/k/v only."""
    if (cfg.use_attention_bias, cfg.use_attention_out_bias, cfg.use_mlp_bias) != (qkv, False, False):
        what = "biases on q/k/v only" if qkv else "no biases"
        raise ConfigError(f"the {family} format has {what}, and this model's biases differ; save it with "
                          "family='llama' (biases on every attention projection and/or the FFN), 'qwen2' (q/k/v only) "
                          "or None (lmkit's own format), or change the config")


def attention_table(cfg: ModelConfig) -> list[tuple]:
    table = [("self_attn.norm.weight", "input_layernorm.weight")]
    for p in ("q_proj", "k_proj", "v_proj", "o_proj"):
        table.append((f"self_attn.sublayer.{p}.weight", f"self_attn.{p}.weight"))
        if cfg.use_attention_out_bias if p == "o_proj" else cfg.use_attention_bias:
            table.append((f"self_attn.sublayer.{p}.bias", f"self_attn.{p}.bias"))
    table.append(("mlp.norm.weight", "post_attention_layernorm.weight"))
    return table


def mlp_table(cfg: ModelConfig) -> list[tuple]:
    table = []
    for p in ("gate_proj", "up_proj", "down_proj"):
        table.append((f"mlp.sublayer.{p}.weight", f"mlp.{p}.weight"))
        if cfg.use_mlp_bias:
            table.append((f"mlp.sublayer.{p}.bias", f"mlp.{p}.bias"))
    return table


def rules(cfg: ModelConfig, layer_table: list[tuple] | None = None) -> list[Rule]:
    """lmkit CausalLM names -> LlamaForCausalLM names (other LLaMA-like families pass their own layer table)."""
    table = layer_table if layer_table is not None else attention_table(cfg) + mlp_table(cfg)
    out = [rename("decoder.embeddings.tokens.weight", "model.embed_tokens.weight")]
    out += layer_rules(cfg.n_layers, table, "decoder.layers.{i}.", "model.layers.{i}.")
    out.append(rename("decoder.norm.weight", "model.norm.weight"))
    if not cfg.tie_embeddings:
        out.append(rename("lm_head.weight", "lm_head.weight"))
    return out


FAMILY = Family(model_types=("llama",), hf_classes=("LlamaForCausalLM", "LlamaModel"), config_from_hf=config_from_hf,
                config_to_hf=config_to_hf, rules=rules, aliases=ALIASES)
