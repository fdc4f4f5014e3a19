"""GPT-2 (GPT2LMHeadModel / GPT2Model): config mapping and weight-name table."""
from __future__ import annotations

from lmkit.config import ModelConfig
from lmkit.errors import ConfigError
from lmkit.hub.convert import DECODER_HEAD_SUFFIXES, HF_ACTIVATIONS, Rule, hf_activation, \
    hf_activation_name, layer_rules, refuse_unloadable, rename
from lmkit.hub.family import Family

ALIASES = (("transformer.", ""),)


def config_from_hf(hf: dict) -> ModelConfig:
    refuse_unloadable(hf, "gpt2", "GPT2LMHeadModel", DECODER_HEAD_SUFFIXES)
    act = hf_activation(hf, "activation_function", "gelu_new", HF_ACTIVATIONS, "GPT-2")
    d = hf.get("n_embd", 768)
    return ModelConfig(
        family="gpt2", architecture="decoder", vocab_size=hf.get("vocab_size", 50257), d_model=d,
        n_layers=hf.get("n_layer", 12), n_heads=hf.get("n_head", 12), d_ff=hf.get("n_inner") or 4 * d,
        max_seq_len=hf.get("n_positions", 1024), position="learned", norm="layernorm", norm_placement="pre",
        norm_eps=hf.get("layer_norm_epsilon", 1e-5), activation=HF_ACTIVATIONS[act], bias=True,
        attention_scale=None if hf.get("scale_attn_weights", True) else 1.0,  # false: softmax(Q K^T), no 1/sqrt(d)
        attention_scale_by_layer=bool(hf.get("scale_attn_by_inverse_layer_idx", False)),
        tie_embeddings=hf.get("tie_word_embeddings", True), bos_token_id=hf.get("bos_token_id", 50256),
        eos_token_id=hf.get("eos_token_id", 50256), pad_token_id=hf.get("pad_token_id"),
        dropout=hf.get("resid_pdrop", 0.1), attention_dropout=hf.get("attn_pdrop", 0.1),
        init_std=hf.get("initializer_range", 0.02),
        # the same scores, computed in float32 by transformers' eager attention only (its default SDPA ignores it);
        # kept so that a saved folder says so too
        extra={"reorder_and_upcast_attn": True} if hf.get("reorder_and_upcast_attn") else {})


def config_to_hf(cfg: ModelConfig) -> dict:
    act = hf_activation_name(cfg.activation, HF_ACTIVATIONS)
    if act is None or cfg.position != "learned" or cfg.norm != "layernorm" or cfg.norm_placement != "pre" \
            or cfg.gated or cfg.resolved_n_kv_heads != cfg.n_heads or not cfg.bias or cfg.resolved_head_dim * cfg.n_heads != cfg.d_model \
            or cfg.attention_scale not in (None, 1.0, cfg.resolved_head_dim ** -0.5):
        raise ConfigError("this model does not fit the GPT-2 format (needs learned positions, pre-LayerNorm, a plain "
                          "FFN, biases, full multi-head attention of d_model / n_heads per head and a score scale of "
                          "1/sqrt(head_dim) or 1); save it with family='llama' or as lmkit config")
    return {
        "architectures": ["GPT2LMHeadModel"], "model_type": "gpt2", "vocab_size": cfg.vocab_size,
        "n_embd": cfg.d_model, "n_layer": cfg.n_layers, "n_head": cfg.n_heads, "n_inner": cfg.resolved_d_ff,
        "n_positions": cfg.max_seq_len, "n_ctx": cfg.max_seq_len, "activation_function": act,
        "layer_norm_epsilon": cfg.norm_eps, "resid_pdrop": cfg.dropout, "embd_pdrop": cfg.dropout,
        "attn_pdrop": cfg.attention_dropout, "initializer_range": cfg.init_std,
        "tie_word_embeddings": cfg.tie_embeddings, "bos_token_id": cfg.bos_token_id, "eos_token_id": cfg.eos_token_id,
        "pad_token_id": cfg.pad_token_id, "scale_attn_weights": cfg.attention_scale != 1.0 or cfg.resolved_head_dim == 1, "use_cache": True,
        "reorder_and_upcast_attn": bool(cfg.extra.get("reorder_and_upcast_attn", False)),
        "scale_attn_by_inverse_layer_idx": cfg.attention_scale_by_layer,
    }


_LAYER = [
    ("self_attn.norm.weight", "h.{i}.ln_1.weight"), ("self_attn.norm.bias", "h.{i}.ln_1.bias"),
    (("self_attn.sublayer.q_proj.weight", "self_attn.sublayer.k_proj.weight", "self_attn.sublayer.v_proj.weight"),
     "h.{i}.attn.c_attn.weight", True),
    (("self_attn.sublayer.q_proj.bias", "self_attn.sublayer.k_proj.bias", "self_attn.sublayer.v_proj.bias"),
     "h.{i}.attn.c_attn.bias"),
    ("self_attn.sublayer.o_proj.weight", "h.{i}.attn.c_proj.weight", True),
    ("self_attn.sublayer.o_proj.bias", "h.{i}.attn.c_proj.bias"),
    ("mlp.norm.weight", "h.{i}.ln_2.weight"), ("mlp.norm.bias", "h.{i}.ln_2.bias"),
    ("mlp.sublayer.up_proj.weight", "h.{i}.mlp.c_fc.weight", True), ("mlp.sublayer.up_proj.bias", "h.{i}.mlp.c_fc.bias"),
    ("mlp.sublayer.down_proj.weight", "h.{i}.mlp.c_proj.weight", True),
    ("mlp.sublayer.down_proj.bias", "h.{i}.mlp.c_proj.bias"),
]


def rules(cfg: ModelConfig) -> list[Rule]:
    """lmkit CausalLM names -> GPT2LMHeadModel names."""
    out = [rename("decoder.embeddings.tokens.weight", "transformer.wte.weight"),
           rename("decoder.embeddings.positions.weight", "transformer.wpe.weight")]
    out += layer_rules(cfg.n_layers, _LAYER, "decoder.layers.{i}.", "transformer.")
    out += [rename("decoder.norm.weight", "transformer.ln_f.weight"), rename("decoder.norm.bias", "transformer.ln_f.bias")]
    if not cfg.tie_embeddings:
        out.append(rename("lm_head.weight", "lm_head.weight"))
    return out


FAMILY = Family(model_types=("gpt2",), hf_classes=("GPT2LMHeadModel", "GPT2Model"), config_from_hf=config_from_hf,
                config_to_hf=config_to_hf, rules=rules, aliases=ALIASES,
                scale_by_layer=True)  # config.json's scale_attn_by_inverse_layer_idx is read and written
