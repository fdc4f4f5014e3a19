"""T5 (T5ForConditionalGeneration / T5Model), v1.0, v1.1 / flan and mT5: config mapping and weight table.

T5: relative position buckets (one table per stack, in its first block), pre-RMSNorm without bias,
no 1/sqrt(d_k) in the scores, ReLU or gated-GELU (tanh) FFN `wi`/`wo`, decoder start = pad.
v1.0 ties the head to the embeddings and scales the decoder output by d^-0.5; v1.1 does neither.
transformers 4.x says which by `tie_word_embeddings`, 5.x by `scale_decoder_outputs`; mT5 (model_type mt5,
v1.1's math with other config defaults) never scales, whatever its config says.
"""
from __future__ import annotations

from lmkit.config import ModelConfig
from lmkit.errors import ConfigError
from lmkit.hub.convert import HF_ACTIVATIONS, HF_GATED_ACTIVATIONS, Rule, hf_activation_name, layer_rules, \
    refuse_unloadable, rename
from lmkit.hub.family import Family

# MT5Config's defaults where they differ from T5Config's (read when config.json leaves them out)
_MT5_DEFAULTS = {"vocab_size": 250112, "d_ff": 1024, "num_layers": 8, "num_heads": 6, "feed_forward_proj": "gated-gelu",
                 "decoder_start_token_id": 0}
# an untied head falls back to the shared table (5.x writes it once when equal); T5Model has no head
ALIASES = (("shared.", "encoder.embed_tokens."), ("lm_head.", "shared."))


def _activation(hf: dict) -> str:
    """feed_forward_proj ("relu", "gated-gelu", "gated-silu", ...) as transformers reads it, where
    config.json's own dense_act_fn / is_gated_act (written by every save) win over it."""
    proj = hf.get("feed_forward_proj", "relu")
    parts = proj.split("-")
    if len(parts) > 2 or (len(parts) == 2 and parts[0] != "gated"):
        raise ConfigError(f"T5 feed_forward_proj {proj!r} is not of the form 'ACT' or 'gated-ACT' (e.g. relu, gated-gelu)")
    act = "gelu_new" if proj == "gated-gelu" else parts[-1]  # what transformers has always run for "gated-gelu"
    act, gated = hf.get("dense_act_fn", act), bool(hf.get("is_gated_act", parts[0] == "gated"))
    table = HF_GATED_ACTIVATIONS if gated else HF_ACTIVATIONS
    if act not in table:
        raise ConfigError(f"T5 activation {act!r} (feed_forward_proj {proj!r}) is not supported; use one of "
                          f"{', '.join(table)}")
    return table[act]


def config_from_hf(hf: dict) -> ModelConfig:
    mt5 = hf.get("model_type") == "mt5"
    refuse_unloadable(hf, "mT5" if mt5 else "T5", "MT5ForConditionalGeneration" if mt5 else "T5ForConditionalGeneration")
    if mt5:
        hf = {**_MT5_DEFAULTS, **hf}
    d = hf.get("d_model", 512)
    tie = hf.get("tie_word_embeddings", True) is not False
    scale = not mt5 and hf.get("scale_decoder_outputs", tie)
    pad = hf.get("pad_token_id", 0)
    n_layers = hf.get("num_layers", 6)
    return ModelConfig(
        family="mt5" if mt5 else "t5", architecture="encoder-decoder", vocab_size=hf.get("vocab_size", 32128), d_model=d,
        n_layers=n_layers, n_decoder_layers=hf.get("num_decoder_layers") or n_layers, n_heads=hf.get("num_heads", 8),
        head_dim=hf.get("d_kv", 64), d_ff=hf.get("d_ff", 2048), max_seq_len=hf.get("n_positions", 512),
        position="relative", relative_buckets=hf.get("relative_attention_num_buckets", 32),
        relative_max_distance=hf.get("relative_attention_max_distance", 128), norm="rmsnorm", norm_placement="pre",
        norm_eps=hf.get("layer_norm_epsilon", 1e-6), norm_bias=False, activation=_activation(hf),
        bias=False, attention_scale=1.0, tie_embeddings=bool(scale), output_scale=d ** -0.5 if scale else 1.0,
        dropout=hf.get("dropout_rate", 0.1), activation_dropout=hf.get("dropout_rate", 0.1), init_std=hf.get("initializer_factor", 1.0) * 0.02,
        pad_token_id=pad, eos_token_id=hf.get("eos_token_id", 1), bos_token_id=hf.get("bos_token_id"),
        decoder_start_token_id=hf.get("decoder_start_token_id", pad))


def config_to_hf(cfg: ModelConfig) -> dict:
    gated = cfg.activation in HF_GATED_ACTIVATIONS.values()
    act = hf_activation_name(cfg.activation, HF_GATED_ACTIVATIONS if gated else HF_ACTIVATIONS)
    # transformers runs dense_act_fn, so gated exact GELU is "gated-gelu" with dense_act_fn "gelu"
    proj = None if act is None else ("gated-gelu" if act.startswith("gelu") else f"gated-{act}") if gated else act
    scaled = abs(cfg.output_scale - cfg.d_model ** -0.5) < 1e-12
    if cfg.position != "relative" or cfg.norm != "rmsnorm" or cfg.norm_placement != "pre" or cfg.use_attention_bias \
            or cfg.use_mlp_bias or cfg.attention_scale != 1.0 or cfg.resolved_n_kv_heads != cfg.n_heads or cfg.embedding_norm \
            or not cfg.final_norm or cfg.architecture != "encoder-decoder" or proj is None \
            or cfg.output_bias or cfg.embedding_scale != 1.0 or cfg.n_experts:
        raise ConfigError("this model does not fit the T5 format (needs relative positions, pre-RMSNorm, no biases, "
                          "unscaled scores and a relu / gelu / silu FFN, gated or not); save it with another family")
    mt5 = cfg.family == "mt5"
    if mt5 and cfg.output_scale != 1.0:
        raise ConfigError(f"mT5 does not scale the decoder output (output_scale={cfg.output_scale}); save it with "
                          "family 't5'")
    if cfg.tie_embeddings != scaled or (not scaled and cfg.output_scale != 1.0):
        raise ConfigError("T5 ties the head and scales the decoder output by d^-0.5 together (v1.0) or neither (v1.1); "
                          f"this config has tie_embeddings={cfg.tie_embeddings}, output_scale={cfg.output_scale}")
    return {
        "architectures": ["MT5ForConditionalGeneration" if mt5 else "T5ForConditionalGeneration"],
        "model_type": "mt5" if mt5 else "t5", "vocab_size": cfg.vocab_size,
        "d_model": cfg.d_model, "d_kv": cfg.resolved_head_dim, "d_ff": cfg.resolved_d_ff, "num_layers": cfg.n_layers,
        "num_decoder_layers": cfg.decoder_layers, "num_heads": cfg.n_heads,
        "relative_attention_num_buckets": cfg.relative_buckets,
        "relative_attention_max_distance": cfg.relative_max_distance, "dropout_rate": cfg.dropout,
        "layer_norm_epsilon": cfg.norm_eps, "initializer_factor": cfg.init_std / 0.02, "feed_forward_proj": proj,
        "dense_act_fn": act, "is_gated_act": gated,
        "is_encoder_decoder": True, "use_cache": True, "tie_word_embeddings": cfg.tie_embeddings,
        **({} if mt5 else {"scale_decoder_outputs": scaled}), "n_positions": cfg.max_seq_len,
        "pad_token_id": cfg.pad_token_id, "eos_token_id": cfg.eos_token_id, "bos_token_id": cfg.bos_token_id,
        "decoder_start_token_id": cfg.decoder_start_token_id if cfg.decoder_start_token_id is not None else cfg.pad_token_id,
    }


def _attention(ours: str, hf: str) -> list[tuple]:
    return [(f"{ours}.sublayer.{p}_proj.weight", f"{hf}.{p}.weight") for p in ("q", "k", "v", "o")]


def _mlp(cfg: ModelConfig, index: int) -> list[tuple]:
    ff = f"layer.{index}.DenseReluDense"
    table = [("mlp.norm.weight", f"layer.{index}.layer_norm.weight"), ("mlp.sublayer.down_proj.weight", f"{ff}.wo.weight")]
    if cfg.gated:
        table += [("mlp.sublayer.gate_proj.weight", f"{ff}.wi_0.weight"), ("mlp.sublayer.up_proj.weight", f"{ff}.wi_1.weight")]
    else:
        table.append(("mlp.sublayer.up_proj.weight", f"{ff}.wi.weight"))
    return table


def rules(cfg: ModelConfig) -> list[Rule]:
    """lmkit Seq2SeqLM names -> T5ForConditionalGeneration names."""
    encoder = [("self_attn.norm.weight", "layer.0.layer_norm.weight")] + _attention("self_attn", "layer.0.SelfAttention")
    encoder += _mlp(cfg, 1)
    decoder = [("self_attn.norm.weight", "layer.0.layer_norm.weight")] + _attention("self_attn", "layer.0.SelfAttention")
    decoder += [("cross_attn.norm.weight", "layer.1.layer_norm.weight")]
    decoder += _attention("cross_attn", "layer.1.EncDecAttention") + _mlp(cfg, 2)
    out = [rename("encoder.embeddings.tokens.weight", "shared.weight")]
    for stack, table, n in (("encoder", encoder, cfg.n_layers), ("decoder", decoder, cfg.decoder_layers)):
        out.append(rename(f"{stack}.relative_bias.bias.weight",
                          f"{stack}.block.0.layer.0.SelfAttention.relative_attention_bias.weight"))
        out += layer_rules(n, table, f"{stack}.layers.{{i}}.", f"{stack}.block.{{i}}.")
        out.append(rename(f"{stack}.norm.weight", f"{stack}.final_layer_norm.weight"))
    if not cfg.tie_embeddings:
        out.append(rename("lm_head.weight", "lm_head.weight"))
    return out


FAMILY = Family(model_types=("t5", "mt5"), hf_classes=("T5ForConditionalGeneration", "MT5ForConditionalGeneration",
                                                      "T5Model", "MT5Model"),
                config_from_hf=config_from_hf, config_to_hf=config_to_hf, rules=rules, aliases=ALIASES)
