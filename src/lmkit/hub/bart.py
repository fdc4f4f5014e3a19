"""BART (BartForConditionalGeneration / BartModel) and mBART: config mapping and weight table.

BART: learned positions offset by 2, a LayerNorm after the embeddings, post-norm blocks
LN(x + F(x)), GELU, biases everywhere, shared and tied embeddings, a fixed `final_logits_bias`
added to the logits, decoder start = eos (2). mBART (hub/mbart.py) is the same table with `LAYOUTS["mbart"]`.
"""
from __future__ import annotations

import torch

from lmkit.config import ModelConfig
from lmkit.errors import ConfigError
from lmkit.hub.convert import HF_ACTIVATIONS, Rule, hf_activation, hf_activation_name, layer_rules, refuse_unloadable, \
    rename
from lmkit.hub.family import Family

# checkpoints that store the table under the stacks' names only; BartModel has no "model." prefix and no head (an
# untied config's head then falls back to the shared table, as T5's does)
ALIASES = (("model.shared.", "model.encoder.embed_tokens."), ("model.encoder.embed_tokens.", "model.shared."),
           ("model.decoder.embed_tokens.", "model.shared."), ("model.", ""), ("lm_head.", "shared."))
_KEPT = ("forced_bos_token_id", "forced_eos_token_id")  # generation settings kept for the round trip
# what sets each format apart: mBART runs pre-norm blocks x + F(LN(x)) with a final LayerNorm `layer_norm` per stack,
# and its teacher forcing starts from the labels' last non-pad token (the language code), not a fixed start token
LAYOUTS = {
    "bart": dict(architecture="BartForConditionalGeneration", name="BART", default_start=2,
                 fields=dict(norm_placement="post", final_norm=False, decoder_start_from_labels=False)),
    "mbart": dict(architecture="MBartForConditionalGeneration", name="mBART", default_start=None,
                  fields=dict(norm_placement="pre", final_norm=True, decoder_start_from_labels=True)),
}


def config_from_hf(hf: dict, family: str = "bart") -> ModelConfig:
    layout = LAYOUTS[family]
    name = layout["name"]
    refuse_unloadable(hf, name, layout["architecture"])
    for a, b in (("encoder_attention_heads", "decoder_attention_heads"), ("encoder_ffn_dim", "decoder_ffn_dim")):
        if hf.get(a, 16 if "heads" in a else 4096) != hf.get(b, 16 if "heads" in b else 4096):
            raise ConfigError(f"{name} with {a}={hf.get(a)} != {b}={hf.get(b)} is not supported by lmkit; "
                              "both stacks must have the same sizes")
    act = hf_activation(hf, "activation_function", "gelu", HF_ACTIVATIONS, name)
    d = hf.get("d_model", 1024)
    bos = hf.get("bos_token_id", 0)
    start = hf.get("decoder_start_token_id", layout["default_start"])
    return ModelConfig(
        family=family, architecture="encoder-decoder", vocab_size=hf.get("vocab_size", 50265), d_model=d,
        n_layers=hf.get("encoder_layers", 12), n_decoder_layers=hf.get("decoder_layers", 12),
        n_heads=hf.get("encoder_attention_heads", 16), d_ff=hf.get("encoder_ffn_dim", 4096),
        max_seq_len=hf.get("max_position_embeddings", 1024), position="learned", position_offset=2,
        norm="layernorm", norm_eps=1e-5, embedding_norm=True, **layout["fields"],
        activation=HF_ACTIVATIONS[act], bias=True, tie_embeddings=hf.get("tie_word_embeddings", True) is not False,
        embedding_scale=d ** 0.5 if hf.get("scale_embedding") else 1.0, output_bias=True,
        dropout=hf.get("dropout", 0.1), attention_dropout=hf.get("attention_dropout", 0.0),
        activation_dropout=hf.get("activation_dropout", 0.0),
        init_std=hf.get("init_std", 0.02), pad_token_id=hf.get("pad_token_id", 1), bos_token_id=bos,
        # generate starts from decoder_start_token_id, else bos_token_id (transformers' rule)
        eos_token_id=hf.get("eos_token_id", 2), decoder_start_token_id=start if start is not None else bos,
        # transformers 5 unties the stacks' token tables from `shared` too when tie_word_embeddings is false
        separate_stack_embeddings=hf.get("tie_word_embeddings", True) is False,
        extra={k: hf[k] for k in _KEPT if k in hf})  # an explicit null too: the class default would replace it


def config_to_hf(cfg: ModelConfig, family: str = "bart") -> dict:
    layout = LAYOUTS[family]
    act = hf_activation_name(cfg.activation, HF_ACTIVATIONS)
    if any(getattr(cfg, k) != v for k, v in layout["fields"].items()):
        other = "BART" if family == "mbart" else "mBART"
        raise ConfigError(f"this model does not fit the {layout['name']} format (needs "
                          f"{', '.join(f'{k}={v}' for k, v in layout['fields'].items())}); save it with family "
                          f"{other.lower()!r} if it fits {other}, or with another family")
    if cfg.position != "learned" or cfg.position_offset != 2 or cfg.norm != "layernorm" \
            or not cfg.embedding_norm or act is None \
            or not cfg.use_attention_bias or not cfg.use_mlp_bias or not cfg.norm_bias or cfg.resolved_n_kv_heads != cfg.n_heads \
            or cfg.resolved_head_dim * cfg.n_heads != cfg.d_model or cfg.attention_scale is not None \
            or cfg.embedding_scale not in (1.0, cfg.d_model ** 0.5) or cfg.output_scale != 1.0 \
            or cfg.architecture != "encoder-decoder" or cfg.n_experts:
        raise ConfigError(f"this model does not fit the {layout['name']} format (needs learned positions with offset 2, "
                          "an embedding LayerNorm, LayerNorm blocks with biases and a plain FFN); save it with another "
                          "family")
    return {
        "architectures": [layout["architecture"]], "model_type": family, "vocab_size": cfg.vocab_size,
        "d_model": cfg.d_model, "encoder_layers": cfg.n_layers, "decoder_layers": cfg.decoder_layers,
        "encoder_attention_heads": cfg.n_heads, "decoder_attention_heads": cfg.n_heads,
        "encoder_ffn_dim": cfg.resolved_d_ff, "decoder_ffn_dim": cfg.resolved_d_ff, "max_position_embeddings": cfg.max_seq_len,
        "activation_function": act, "scale_embedding": cfg.embedding_scale != 1.0, "dropout": cfg.dropout,
        "attention_dropout": cfg.attention_dropout, "activation_dropout": cfg.activation_dropout, "init_std": cfg.init_std,
        "tie_word_embeddings": cfg.tie_embeddings, "is_encoder_decoder": True, "use_cache": True,
        "pad_token_id": cfg.pad_token_id, "bos_token_id": cfg.bos_token_id, "eos_token_id": cfg.eos_token_id,
        "decoder_start_token_id": cfg.decoder_start_token_id, **{k: cfg.extra[k] for k in _KEPT if k in cfg.extra},
    }


def prepare_weights(hf: dict[str, torch.Tensor]) -> dict[str, torch.Tensor]:
    """`final_logits_bias` is optional in BART folders (transformers then keeps zeros): add those zeros."""
    if "final_logits_bias" not in hf:
        table = next((hf[k] for k in ("model.shared.weight", "shared.weight", "model.encoder.embed_tokens.weight",
                                      "encoder.embed_tokens.weight") if k in hf), None)
        if table is not None:
            hf = {**hf, "final_logits_bias": torch.zeros(1, table.shape[0], dtype=table.dtype)}
    return hf


def _attention(ours: str, hf: str) -> list[tuple]:
    out = []
    for p, q in (("q_proj", "q_proj"), ("k_proj", "k_proj"), ("v_proj", "v_proj"), ("o_proj", "out_proj")):
        out += [(f"{ours}.sublayer.{p}.{w}", f"{hf}.{q}.{w}") for w in ("weight", "bias")]
    out += [(f"{ours}.norm.{w}", f"{hf}_layer_norm.{w}") for w in ("weight", "bias")]
    return out


_MLP = [(f"mlp.{ours}.{w}", f"{hf}.{w}") for ours, hf in (("sublayer.up_proj", "fc1"), ("sublayer.down_proj", "fc2"),
                                                             ("norm", "final_layer_norm")) for w in ("weight", "bias")]


def rules(cfg: ModelConfig) -> list[Rule]:
    """lmkit Seq2SeqLM names -> BartForConditionalGeneration / MBartForConditionalGeneration names."""
    out = [rename("encoder.embeddings.tokens.weight", "model.shared.weight")]
    tables = {"encoder": _attention("self_attn", "self_attn") + _MLP,
              "decoder": _attention("self_attn", "self_attn") + _attention("cross_attn", "encoder_attn") + _MLP}
    for stack, n in (("encoder", cfg.n_layers), ("decoder", cfg.decoder_layers)):
        out.append(rename(f"{stack}.embeddings.positions.weight", f"model.{stack}.embed_positions.weight"))
        out += [rename(f"{stack}.embeddings.norm.{w}", f"model.{stack}.layernorm_embedding.{w}") for w in ("weight", "bias")]
        out += layer_rules(n, tables[stack], f"{stack}.layers.{{i}}.", f"model.{stack}.layers.{{i}}.")
        if cfg.final_norm:  # mBART
            out += [rename(f"{stack}.norm.{w}", f"model.{stack}.layer_norm.{w}") for w in ("weight", "bias")]
    # transformers 5 unties the stacks' tables from shared when the head is untied: they are written then (the shared
    # table under each name if the model has one), and read after shared, so the tables the stacks use win
    if cfg.separate_stack_embeddings or not cfg.tie_embeddings:
        out += [rename(f"{stack}.embeddings.tokens.weight", f"model.{stack}.embed_tokens.weight")
                for stack in ("encoder", "decoder")]
    if not cfg.tie_embeddings:
        out.append(rename("lm_head.weight", "lm_head.weight"))
    out.append(rename("final_logits_bias", "final_logits_bias"))
    return out


FAMILY = Family(model_types=("bart",), hf_classes=("BartForConditionalGeneration", "BartModel"),
                config_from_hf=config_from_hf, config_to_hf=config_to_hf, rules=rules, aliases=ALIASES,
                prepare_weights=prepare_weights)
