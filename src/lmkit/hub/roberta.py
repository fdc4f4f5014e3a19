"""RoBERTa (RobertaModel, RobertaForMaskedLM, ...ForSequenceClassification/TokenClassification/
QuestionAnswering/MultipleChoice): the BERT tables with RoBERTa's names and its positions.

Positions start at padding_idx + 1 and skip padding (position_offset = pad + 1,
position_skip_padding), so max_position_embeddings = max_seq_len + pad + 1 (514 for 512 tokens).
The masked-LM head always uses exact GELU, whatever hidden_act says.
"""
from __future__ import annotations

import dataclasses

from lmkit.config import ModelConfig
from lmkit.errors import ConfigError
from lmkit.hub.bert import (_EMBEDDINGS, _LAYER, EncoderFormat, build_encoder, encoder_config_from_hf,
                            encoder_config_to_hf, format_rules, linear, with_architecture)
from lmkit.hub.convert import Rule
from lmkit.hub.family import Family

_MLM = linear("mlm_head.dense", "lm_head.dense") + linear("mlm_head.norm", "lm_head.layer_norm") \
    + [("mlm_head.bias", "lm_head.bias"), ("mlm_head.bias", "lm_head.decoder.bias")]

FORMAT = EncoderFormat(
    model_type="roberta", prefix="roberta.", embeddings=_EMBEDDINGS, layer_prefix="encoder.layer.{i}.", layer=_LAYER,
    archs={"RobertaModel": (None, "tanh"), "RobertaForMaskedLM": ("mlm", None),
           "RobertaForSequenceClassification": ("sequence", "tanh"), "RobertaForTokenClassification": ("token", None),
           "RobertaForQuestionAnswering": ("qa", None), "RobertaForMultipleChoice": ("choice", "tanh")},
    pooler={None: "roberta.pooler.dense", "sequence": "classifier.dense", "choice": "roberta.pooler.dense"},
    heads={"mlm": _MLM, "sequence": linear("classifier", "classifier.out_proj"),
           "token": linear("classifier", "classifier"), "qa": linear("qa_outputs", "qa_outputs"),
           "choice": linear("classifier", "classifier")},
    mlm_decoder="lm_head.decoder.weight",
    aliases=(("lm_head.bias", "lm_head.decoder.bias"), ("lm_head.decoder.bias", "lm_head.bias")))
ALIASES = (("roberta.", ""), ("embeddings.", "roberta.embeddings."), ("encoder.", "roberta.encoder."),
           ("pooler.", "roberta.pooler.")) + FORMAT.aliases


def config_from_hf(hf: dict) -> ModelConfig:
    """Keys config.json leaves out take RobertaConfig's defaults (not roberta-base's values: 512 positions,
    2 token types, LayerNorm eps 1e-12), as transformers reads such a file."""
    pad = hf.get("pad_token_id", 1)
    offset = pad + 1
    n_pos = hf.get("max_position_embeddings", 512)
    if n_pos <= offset:
        raise ConfigError(f"RoBERTa max_position_embeddings={n_pos} leaves no position after padding_idx={pad}")
    fields = dict(max_seq_len=n_pos - offset, position_offset=offset, position_skip_padding=True, pad_token_id=pad,
                  vocab_size=hf.get("vocab_size", 50265), type_vocab_size=hf.get("type_vocab_size", 2),
                  norm_eps=hf.get("layer_norm_eps", 1e-12), bos_token_id=hf.get("bos_token_id", 0),
                  eos_token_id=hf.get("eos_token_id", 2))
    cfg = encoder_config_from_hf(hf, "roberta", **fields)
    return cfg.replace(task=dataclasses.replace(cfg.task, mlm_activation="gelu"))


def config_to_hf(cfg: ModelConfig, fmt: EncoderFormat = FORMAT) -> dict:
    """config.json of a RoBERTa-like model, in the format `fmt` (RoBERTa's, or a family built on it)."""
    if cfg.pad_token_id is None or cfg.position_offset != cfg.pad_token_id + 1 or not cfg.position_skip_padding:
        raise ConfigError(f"the {fmt.model_type} format needs positions that skip padding and start at pad_token_id + 1 "
                          "(position_skip_padding=True, position_offset=pad_token_id + 1); use family='bert' otherwise")
    mlm_act = cfg.task.get("mlm_activation", cfg.activation)
    if cfg.task.get("head") == "mlm" and mlm_act != "gelu":
        raise ConfigError(f"the {fmt.model_type} format runs the masked-LM head with exact GELU whatever hidden_act says, and "
                          f"this model's head runs {mlm_act}; build it with task=TaskHead(mlm_activation='gelu') or save it "
                          "with family=None")
    raw = encoder_config_to_hf(cfg, fmt.model_type, cfg.max_seq_len + cfg.position_offset)
    return with_architecture(fmt, cfg, raw)


def rules(cfg: ModelConfig) -> list[Rule]:
    return format_rules(FORMAT, cfg)


def build(config: ModelConfig, raw: dict, names=()):
    return build_encoder(FORMAT, config, raw, names)


FAMILY = Family(model_types=("roberta",), hf_classes=tuple(FORMAT.archs), config_from_hf=config_from_hf,
                config_to_hf=config_to_hf, rules=rules, aliases=ALIASES, build=build)
