"""BigBird (BigBirdModel, BigBirdForMaskedLM, BigBirdForSequenceClassification): BERT's tables under the "bert."
prefix, the attention pattern (attention_type, block_size, num_random_blocks) in `ModelConfig.sparse`.

The classifier reads token 0 through dense + the model's hidden activation (not tanh) + out_proj; the bare
model's pooler is BERT's tanh pooler. rescale_embeddings multiplies the token embeddings by sqrt(hidden_size).
"""
from __future__ import annotations

import dataclasses

from lmkit.config import ModelConfig
from lmkit.config_sections import SparseAttention
from lmkit.errors import ConfigError
from lmkit.hub import bert
from lmkit.hub.bert import EncoderFormat, build_encoder, encoder_config_from_hf, encoder_config_to_hf, format_rules, linear
from lmkit.hub.convert import Rule
from lmkit.hub.family import Family

SEQUENCE = "BigBirdForSequenceClassification"
FORMAT = dataclasses.replace(
    bert.FORMAT, model_type="big_bird",
    archs={"BigBirdModel": (None, "tanh"), "BigBirdForMaskedLM": ("mlm", None), SEQUENCE: ("sequence", "gelu")},
    pooler={None: "bert.pooler", "sequence": "classifier.dense"},  # BigBirdModel's pooler is one nn.Linear
    heads={"mlm": bert.FORMAT.heads["mlm"], "sequence": linear("classifier", "classifier.out_proj")})
ALIASES = bert.ALIASES


def format_of(cfg: ModelConfig) -> EncoderFormat:
    """The format with the classifier's activation set to the model's own."""
    return dataclasses.replace(FORMAT, archs={**FORMAT.archs, SEQUENCE: ("sequence", cfg.activation)})


def config_from_hf(hf: dict) -> ModelConfig:
    """BERT's reading with BigBirdConfig's defaults where keys are missing, plus the attention pattern."""
    hf = {"vocab_size": 50358, "hidden_act": "gelu_new", "max_position_embeddings": 4096, "bos_token_id": 1,
          "eos_token_id": 2, **hf}
    kind = hf.get("attention_type", "block_sparse")
    sparse = SparseAttention(sparse_attention="bigbird", attention_type=kind, block_size=hf.get("block_size", 64),
                             num_random_blocks=hf.get("num_random_blocks", 3))
    cfg = encoder_config_from_hf(hf, "big_bird", sparse=sparse, attention_bias=hf.get("use_bias", True))
    extra = dict(cfg.extra)
    if hf.get("sep_token_id") is not None:
        extra["sep_token_id"] = hf["sep_token_id"]
    if hf.get("rescale_embeddings"):
        cfg = cfg.replace(embedding_scale=cfg.d_model ** 0.5)
    return cfg.replace(extra=extra)


def config_to_hf(cfg: ModelConfig) -> dict:
    sparse = cfg.sparse
    if sparse.get("sparse_attention") != "bigbird":
        raise ConfigError("the BigBird format needs BigBird attention (sparse_attention='bigbird'); save this model "
                          "with family='bert' or None")
    if cfg.position_offset or cfg.position_skip_padding or not cfg.type_vocab_size:
        raise ConfigError("the BigBird format needs BERT's positions (from 0, padding counted) and segment embeddings")
    if cfg.embedding_scale not in (1.0, cfg.d_model ** 0.5):
        raise ConfigError(f"the BigBird format scales token embeddings by 1 or sqrt(d_model) only, this model by "
                          f"{cfg.embedding_scale}; save it with family=None")
    if cfg.attention_bias is not None and cfg.attention_bias != cfg.bias or cfg.attention_out_bias is not None:
        raise ConfigError("the BigBird format has biases on all of q, k, v or none (use_bias) and always on the output "
                          "projection; save this model with family=None")
    raw = encoder_config_to_hf(cfg.replace(family="big_bird"), "big_bird", cfg.max_seq_len)
    raw = bert.with_architecture(format_of(cfg), cfg, raw)
    raw.update(attention_type=sparse.get("attention_type", "block_sparse"), block_size=sparse.get("block_size", 64),
               num_random_blocks=sparse.get("num_random_blocks", 3), use_bias=cfg.use_attention_bias,
               rescale_embeddings=cfg.embedding_scale != 1.0, sep_token_id=cfg.extra.get("sep_token_id", 66))
    return raw


def rules(cfg: ModelConfig) -> list[Rule]:
    return format_rules(format_of(cfg), cfg)


def build(config: ModelConfig, raw: dict, names=()):
    # build_encoder tells a bare model without pooler by a missing "pooler.dense.weight"; BigBird's is "pooler.weight"
    names = [n.replace("pooler.weight", "pooler.dense.weight") for n in names]
    return build_encoder(format_of(config), config, raw, names)


FAMILY = Family(model_types=("big_bird",), hf_classes=tuple(FORMAT.archs), config_from_hf=config_from_hf,
                config_to_hf=config_to_hf, rules=rules, aliases=ALIASES, build=build)
