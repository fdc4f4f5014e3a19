"""Longformer (LongformerModel, LongformerForMaskedLM, LongformerForSequenceClassification): RoBERTa's tables
plus each layer's global projections (query_global, key_global, value_global) and its attention_window.

config.json's attention_window is one int for every layer or a list of one per layer; lmkit keeps the list
(`ModelConfig.sparse`) and writes it back as a list, which transformers reads the same.
"""
from __future__ import annotations

import dataclasses

from lmkit.config import ModelConfig
from lmkit.config_sections import SparseAttention
from lmkit.errors import ConfigError
from lmkit.hub import roberta
from lmkit.hub.bert import _LAYER, build_encoder, format_rules, linear
from lmkit.hub.convert import Rule
from lmkit.hub.family import Family

_GLOBAL = (linear("self_attn.sublayer.q_global", "attention.self.query_global")
           + linear("self_attn.sublayer.k_global", "attention.self.key_global")
           + linear("self_attn.sublayer.v_global", "attention.self.value_global"))

FORMAT = dataclasses.replace(
    roberta.FORMAT, model_type="longformer", prefix="longformer.", layer=_LAYER + _GLOBAL,
    archs={"LongformerModel": (None, "tanh"), "LongformerForMaskedLM": ("mlm", None),
           "LongformerForSequenceClassification": ("sequence", "tanh")},
    pooler={None: "longformer.pooler.dense", "sequence": "classifier.dense"},
    heads={h: roberta.FORMAT.heads[h] for h in ("mlm", "sequence")})
ALIASES = (("longformer.", ""), ("embeddings.", "longformer.embeddings."), ("encoder.", "longformer.encoder."),
           ("pooler.", "longformer.pooler.")) + FORMAT.aliases


def config_from_hf(hf: dict) -> ModelConfig:
    """RoBERTa's reading (LongformerConfig's defaults where keys are missing) plus the per-layer windows."""
    hf = {"vocab_size": 30522, "type_vocab_size": 2, **hf}
    cfg = roberta.config_from_hf(hf)
    n = cfg.n_layers
    window = hf.get("attention_window", 512)
    if not isinstance(window, (int, list)):
        raise ConfigError(f"attention_window={window!r} must be one even window for every layer or a list of one per layer")
    windows = [window] * n if isinstance(window, int) else list(window)
    if len(windows) != n:
        raise ConfigError(f"attention_window lists {len(windows)} windows for {n} layers; give one per layer")
    sparse = SparseAttention(sparse_attention="longformer", attention_window=windows)
    extra = dict(cfg.extra)
    if hf.get("sep_token_id") is not None:
        extra["sep_token_id"] = hf["sep_token_id"]
    return cfg.replace(family="longformer", sparse=sparse, extra=extra)


def config_to_hf(cfg: ModelConfig) -> dict:
    if cfg.sparse.get("sparse_attention") != "longformer":
        raise ConfigError("the Longformer format needs Longformer attention (sparse_attention='longformer' with an "
                          "attention_window per layer); save this model with family='roberta' or None")
    windows = cfg.sparse.attention_window
    if min(windows) < 4 or any(max(windows) % w for w in windows):
        # transformers pads to the largest window and cuts each layer's keys into chunks of its own window
        raise ConfigError(f"transformers' Longformer cannot run attention_window {windows}: each window must be 4 or "
                          "more and divide the largest one (lmkit runs any even windows); change the windows or save "
                          "with family=None")
    raw = roberta.config_to_hf(cfg, FORMAT)
    raw.update(attention_window=list(cfg.sparse.attention_window), sep_token_id=cfg.extra.get("sep_token_id", 2 if cfg.eos_token_id is None else cfg.eos_token_id),
               onnx_export=False)
    return raw


def rules(cfg: ModelConfig) -> list[Rule]:
    return format_rules(FORMAT, cfg)


def build(config: ModelConfig, raw: dict, names=()):
    return build_encoder(FORMAT, config, raw, names)


FAMILY = Family(model_types=("longformer",), hf_classes=tuple(FORMAT.archs), config_from_hf=config_from_hf,
                config_to_hf=config_to_hf, rules=rules, aliases=ALIASES, build=build)
