"""DistilBERT (DistilBertModel, DistilBertForMaskedLM, ...ForSequenceClassification/TokenClassification/
QuestionAnswering/MultipleChoice): config mapping and weight-name tables.

A post-norm encoder without segment embeddings; LayerNorm eps is fixed at 1e-12; the sequence
classifier is pre_classifier + ReLU on [CLS] (lmkit's pooler with a ReLU) then classifier.
Sinusoidal position tables (sinusoidal_pos_embds) are stored as weights and load as learned ones.
"""
from __future__ import annotations

from lmkit.config import ModelConfig
from lmkit.config_sections import TaskHead
from lmkit.errors import ConfigError
from lmkit.hub.bert import EncoderFormat, build_encoder, check_encoder, format_rules, labels_to_hf, linear, \
    num_labels_of, problem_type_of, with_architecture
from lmkit.hub.convert import HF_ACTIVATIONS, Rule, hf_activation
from lmkit.hub.family import Family

_EMBEDDINGS = [("tokens.weight", "embeddings.word_embeddings.weight"),
               ("positions.weight", "embeddings.position_embeddings.weight")] + linear("norm", "embeddings.LayerNorm")
_LAYER = (linear("self_attn.sublayer.q_proj", "attention.q_lin") + linear("self_attn.sublayer.k_proj", "attention.k_lin")
          + linear("self_attn.sublayer.v_proj", "attention.v_lin") + linear("self_attn.sublayer.o_proj", "attention.out_lin")
          + linear("self_attn.norm", "sa_layer_norm") + linear("mlp.sublayer.up_proj", "ffn.lin1")
          + linear("mlp.sublayer.down_proj", "ffn.lin2") + linear("mlp.norm", "output_layer_norm"))
_MLM = linear("mlm_head.dense", "vocab_transform") + linear("mlm_head.norm", "vocab_layer_norm") \
    + [("mlm_head.bias", "vocab_projector.bias")]

FORMAT = EncoderFormat(
    model_type="distilbert", prefix="distilbert.", embeddings=_EMBEDDINGS, layer_prefix="transformer.layer.{i}.",
    layer=_LAYER,
    archs={"DistilBertModel": (None, None), "DistilBertForMaskedLM": ("mlm", None),
           "DistilBertForSequenceClassification": ("sequence", "relu"),
           "DistilBertForTokenClassification": ("token", None), "DistilBertForQuestionAnswering": ("qa", None),
           "DistilBertForMultipleChoice": ("choice", "relu")},
    pooler={"sequence": "pre_classifier", "choice": "pre_classifier"},
    heads={"mlm": _MLM, "sequence": linear("classifier", "classifier"), "token": linear("classifier", "classifier"),
           "qa": linear("qa_outputs", "qa_outputs"), "choice": linear("classifier", "classifier")},
    mlm_decoder="vocab_projector.weight")
ALIASES = (("distilbert.", ""), ("embeddings.", "distilbert.embeddings."), ("transformer.", "distilbert.transformer."))


def config_from_hf(hf: dict) -> ModelConfig:
    act = hf_activation(hf, "activation", "gelu", HF_ACTIVATIONS, "DistilBERT")
    # qa_dropout (before DistilBertForQuestionAnswering's qa_outputs) is kept for the save only: lmkit's QA head,
    # as BERT's, has no dropout
    task = TaskHead(num_labels=num_labels_of(hf), classifier_dropout=hf.get("seq_classif_dropout", 0.2),
                    problem_type=problem_type_of(hf))
    extra = {"qa_dropout": hf.get("qa_dropout", 0.1)}
    if hf.get("id2label"):
        extra["id2label"] = {str(k): v for k, v in hf["id2label"].items()}
    return ModelConfig(
        family="distilbert", architecture="encoder", vocab_size=hf.get("vocab_size", 30522), d_model=hf.get("dim", 768),
        n_layers=hf.get("n_layers", 6), n_heads=hf.get("n_heads", 12), d_ff=hf.get("hidden_dim", 3072),
        max_seq_len=hf.get("max_position_embeddings", 512), position="learned", norm="layernorm",
        norm_placement="post", norm_eps=1e-12, final_norm=False, embedding_norm=True, activation=HF_ACTIVATIONS[act],
        bias=True, type_vocab_size=0, tie_embeddings=hf.get("tie_word_embeddings", True),
        pad_token_id=hf.get("pad_token_id", 0), dropout=hf.get("dropout", 0.1),
        attention_dropout=hf.get("attention_dropout", 0.1), init_std=hf.get("initializer_range", 0.02),
        task=task, extra=extra)


def config_to_hf(cfg: ModelConfig) -> dict:
    act = check_encoder(cfg, "distilbert")
    if cfg.type_vocab_size or cfg.position_offset or cfg.position_skip_padding or cfg.norm_eps != 1e-12:
        raise ConfigError("the DistilBERT format has no segment embeddings, positions from 0 and LayerNorm eps 1e-12; "
                          "use family='bert' for this config")
    labels = labels_to_hf(cfg)
    classifier_dropout = labels.pop("classifier_dropout")
    raw = {"model_type": "distilbert", "vocab_size": cfg.vocab_size, "dim": cfg.d_model, "n_layers": cfg.n_layers,
           "n_heads": cfg.n_heads, "hidden_dim": cfg.resolved_d_ff, "activation": act,
           "max_position_embeddings": cfg.max_seq_len, "sinusoidal_pos_embds": False, "dropout": cfg.dropout,
           "attention_dropout": cfg.attention_dropout, "initializer_range": cfg.init_std,
           "seq_classif_dropout": 0.2 if classifier_dropout is None else classifier_dropout, "qa_dropout": cfg.extra.get("qa_dropout", cfg.dropout),
           "pad_token_id": cfg.pad_token_id, "tie_word_embeddings": cfg.tie_embeddings, **labels}
    return with_architecture(FORMAT, cfg, raw)


def rules(cfg: ModelConfig) -> list[Rule]:
    return format_rules(FORMAT, cfg)


def build(config: ModelConfig, raw: dict, names=()):
    return build_encoder(FORMAT, config, raw, names)


FAMILY = Family(model_types=("distilbert",), hf_classes=tuple(FORMAT.archs), config_from_hf=config_from_hf,
                config_to_hf=config_to_hf, rules=rules, aliases=ALIASES, build=build)
