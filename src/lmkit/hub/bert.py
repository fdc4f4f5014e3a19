"""BERT (BertModel, BertForMaskedLM, ...ForPreTraining/NextSentencePrediction/SequenceClassification/
TokenClassification/QuestionAnswering/MultipleChoice): config mapping and weight-name tables.

The encoder families (BERT, RoBERTa, DistilBERT) share the machinery below; each describes its
format as data in an `EncoderFormat`: names of the embeddings, of one layer, of the pooler and
of each head, and which Hugging Face class holds which lmkit head.
"""
from __future__ import annotations

from dataclasses import dataclass, field

from lmkit.config import ModelConfig
from lmkit.config_sections import TaskHead
from lmkit.errors import ConfigError
from lmkit.hub.convert import HF_ACTIVATIONS, Rule, hf_activation, hf_activation_name, layer_rules, rename
from lmkit.hub.family import Family
from lmkit.models.encoder import Encoder


def linear(ours: str, hf: str) -> list[tuple[str, str]]:
    """Weight and bias of one linear (or LayerNorm) module."""
    return [(f"{ours}.weight", f"{hf}.weight"), (f"{ours}.bias", f"{hf}.bias")]


@dataclass(frozen=True)
class EncoderFormat:
    model_type: str
    prefix: str                                   # the base model's name inside head classes ("bert.")
    embeddings: list[tuple[str, str]]             # lmkit name under encoder.embeddings. -> hf name under prefix
    layer_prefix: str                             # hf name of layer {i} under prefix
    layer: list[tuple[str, str]]                  # lmkit name under encoder.layers.{i}. -> hf name under layer_prefix
    archs: dict[str, tuple[str | None, str | None]]  # HF class -> (lmkit head, pooler activation)
    pooler: dict[str | None, str]                 # head -> hf module of the pooler dense (absolute)
    heads: dict[str, list[tuple[str, str]]]       # head -> (lmkit name, absolute hf name)
    mlm_decoder: str                              # hf name of the untied MLM output matrix
    aliases: tuple[tuple[str, str], ...] = field(default=())

    def arch_of(self, head: str | None, pooler: str | None) -> str:
        for arch, (h, p) in self.archs.items():
            if h == head and (p == pooler or head is None):
                return arch
        raise ConfigError(f"the {self.model_type} format has no class for head={head!r} with pooler={pooler!r}; "
                          f"save the model in lmkit's own format (family=None)")


_LAYER = (linear("self_attn.sublayer.q_proj", "attention.self.query") + linear("self_attn.sublayer.k_proj", "attention.self.key")
          + linear("self_attn.sublayer.v_proj", "attention.self.value")
          + linear("self_attn.sublayer.o_proj", "attention.output.dense") + linear("self_attn.norm", "attention.output.LayerNorm")
          + linear("mlp.sublayer.up_proj", "intermediate.dense") + linear("mlp.sublayer.down_proj", "output.dense")
          + linear("mlp.norm", "output.LayerNorm"))
_EMBEDDINGS = [("tokens.weight", "embeddings.word_embeddings.weight"),
               ("positions.weight", "embeddings.position_embeddings.weight"),
               ("token_types.weight", "embeddings.token_type_embeddings.weight")] + linear("norm", "embeddings.LayerNorm")
_MLM = linear("mlm_head.dense", "cls.predictions.transform.dense") + linear("mlm_head.norm", "cls.predictions.transform.LayerNorm") \
    + [("mlm_head.bias", "cls.predictions.bias"), ("mlm_head.bias", "cls.predictions.decoder.bias")]

FORMAT = EncoderFormat(
    model_type="bert", prefix="bert.", embeddings=_EMBEDDINGS, layer_prefix="encoder.layer.{i}.", layer=_LAYER,
    archs={"BertModel": (None, "tanh"), "BertForMaskedLM": ("mlm", None), "BertForPreTraining": ("pretraining", "tanh"),
           "BertForNextSentencePrediction": ("nsp", "tanh"), "BertForSequenceClassification": ("sequence", "tanh"),
           "BertForTokenClassification": ("token", None), "BertForQuestionAnswering": ("qa", None),
           "BertForMultipleChoice": ("choice", "tanh")},
    pooler={h: "bert.pooler.dense" for h in (None, "pretraining", "nsp", "sequence", "choice")},
    heads={"mlm": _MLM, "pretraining": _MLM + linear("nsp_head", "cls.seq_relationship"),
           "nsp": linear("nsp_head", "cls.seq_relationship"), "sequence": linear("classifier", "classifier"),
           "token": linear("classifier", "classifier"), "qa": linear("qa_outputs", "qa_outputs"),
           "choice": linear("classifier", "classifier")},
    mlm_decoder="cls.predictions.decoder.weight",
    # transformers 5 keeps decoder.bias apart from bias when untied and uses decoder.bias; both are written, the
    # second read wins, and a checkpoint holding only one of the names loads through these aliases
    aliases=(("cls.predictions.bias", "cls.predictions.decoder.bias"), ("cls.predictions.decoder.bias", "cls.predictions.bias")))
ALIASES = (("bert.", ""), ("embeddings.", "bert.embeddings."), ("encoder.", "bert.encoder."),
           ("pooler.", "bert.pooler.")) + FORMAT.aliases


PROBLEM_TYPES = ("regression", "single_label_classification", "multi_label_classification")


def problem_type_of(hf: dict) -> str | None:
    """config.json's problem_type (which loss the sequence head trains with), checked."""
    kind = hf.get("problem_type")
    if kind is not None and kind not in PROBLEM_TYPES:
        raise ConfigError(f"problem_type {kind!r} is not supported; use one of {', '.join(PROBLEM_TYPES)}")
    return kind


def num_labels_of(hf: dict) -> int:
    if hf.get("id2label"):
        return len(hf["id2label"])
    return int(hf.get("num_labels", 2))


def encoder_config_from_hf(hf: dict, family: str, **fields) -> ModelConfig:
    """The settings BERT-like configs share (BERT and RoBERTa spell them alike)."""
    act = hf_activation(hf, "hidden_act", "gelu", HF_ACTIVATIONS, family)
    kind = hf.get("position_embedding_type", "absolute")
    if kind not in ("absolute", None):
        raise ConfigError(f"{family} position_embedding_type={kind!r} is not supported; lmkit loads 'absolute' only")
    if hf.get("is_decoder") or hf.get("add_cross_attention"):
        raise ConfigError(f"this {family} config is a decoder (is_decoder/add_cross_attention); lmkit loads encoders only")
    task = TaskHead(classifier_dropout=hf.get("classifier_dropout"), num_labels=num_labels_of(hf),
                    problem_type=problem_type_of(hf))
    extra = {}
    if hf.get("id2label"):
        extra["id2label"] = {str(k): v for k, v in hf["id2label"].items()}
    values = dict(
        family=family, architecture="encoder", vocab_size=hf.get("vocab_size", 30522), d_model=hf.get("hidden_size", 768),
        n_layers=hf.get("num_hidden_layers", 12), n_heads=hf.get("num_attention_heads", 12),
        d_ff=hf.get("intermediate_size", 3072), max_seq_len=hf.get("max_position_embeddings", 512), position="learned",
        norm="layernorm", norm_placement="post", norm_eps=hf.get("layer_norm_eps", 1e-12), final_norm=False,
        embedding_norm=True, activation=HF_ACTIVATIONS[act], bias=True, type_vocab_size=hf.get("type_vocab_size", 2),
        tie_embeddings=hf.get("tie_word_embeddings", True), pad_token_id=hf.get("pad_token_id", 0),
        bos_token_id=hf.get("bos_token_id"), eos_token_id=hf.get("eos_token_id"),
        dropout=hf.get("hidden_dropout_prob", 0.1), attention_dropout=hf.get("attention_probs_dropout_prob", 0.1),
        init_std=hf.get("initializer_range", 0.02), task=task, extra=extra)
    values.update(fields)
    return ModelConfig(**values)


def config_from_hf(hf: dict) -> ModelConfig:
    return encoder_config_from_hf(hf, "bert")


def check_encoder(cfg: ModelConfig, family: str) -> str:
    """The HF hidden_act of an lmkit config that fits a BERT-like format, or a ConfigError saying why not."""
    act = hf_activation_name(cfg.activation, HF_ACTIVATIONS)
    sparse = cfg.sparse.get("sparse_attention")
    if sparse is not None and sparse != family.replace("_", ""):
        raise ConfigError(f"this model attends with {sparse}'s sparse pattern, which the {family} format cannot hold; "
                          f"save it with family={'big_bird' if sparse == 'bigbird' else sparse!r} or family=None")
    if act is None or cfg.architecture != "encoder" or cfg.position != "learned" or cfg.norm != "layernorm" \
            or cfg.norm_placement != "post" or not cfg.embedding_norm or cfg.final_norm or cfg.resolved_n_kv_heads != cfg.n_heads \
            or not cfg.bias or cfg.resolved_head_dim * cfg.n_heads != cfg.d_model or cfg.n_experts:
        raise ConfigError(f"this model does not fit the {family} format (needs a post-LayerNorm encoder with learned "
                          f"positions, an embedding LayerNorm, a plain FFN, biases and full multi-head attention); "
                          f"save it with family=None for lmkit's own format")
    return act


def labels_to_hf(cfg: ModelConfig) -> dict:
    n = int(cfg.task.get("num_labels", 2))
    id2label = cfg.extra.get("id2label") or {str(i): f"LABEL_{i}" for i in range(n)}
    return {"id2label": id2label, "label2id": {v: int(k) for k, v in id2label.items()},
            "classifier_dropout": cfg.task.get("classifier_dropout"), "problem_type": cfg.task.get("problem_type")}


def encoder_config_to_hf(cfg: ModelConfig, family: str, max_positions: int) -> dict:
    act = check_encoder(cfg, family)
    return {
        "model_type": family, "vocab_size": cfg.vocab_size, "hidden_size": cfg.d_model,
        "num_hidden_layers": cfg.n_layers, "num_attention_heads": cfg.n_heads, "intermediate_size": cfg.resolved_d_ff,
        "hidden_act": act, "max_position_embeddings": max_positions, "type_vocab_size": max(cfg.type_vocab_size, 1),
        "layer_norm_eps": cfg.norm_eps, "pad_token_id": cfg.pad_token_id, "bos_token_id": cfg.bos_token_id,
        "eos_token_id": cfg.eos_token_id, "hidden_dropout_prob": cfg.dropout,
        "attention_probs_dropout_prob": cfg.attention_dropout, "initializer_range": cfg.init_std,
        "position_embedding_type": "absolute", "tie_word_embeddings": cfg.tie_embeddings, "is_decoder": False,
        "use_cache": False, **labels_to_hf(cfg)}


def config_to_hf(cfg: ModelConfig) -> dict:
    if cfg.position_offset or cfg.position_skip_padding:
        raise ConfigError("BERT positions start at 0 and count padding; this config is RoBERTa-like: use family='roberta'")
    if not cfg.type_vocab_size:
        raise ConfigError("the BERT format needs segment embeddings (type_vocab_size >= 1)")
    raw = encoder_config_to_hf(cfg, "bert", cfg.max_seq_len)
    return with_architecture(FORMAT, cfg, raw)


def with_architecture(fmt: EncoderFormat, cfg: ModelConfig, raw: dict) -> dict:
    """raw plus the HF class of the model's head. A bare model without pooler is told by its missing tensors, as
    transformers writes it: an add_pooling_layer key in config.json would swallow the from_pretrained(...,
    add_pooling_layer=False) that builds transformers' model without one (lmkit still reads the key)."""
    head, pooler = cfg.task.get("head"), cfg.task.get("pooler")
    raw["architectures"] = [fmt.arch_of(head, pooler)]
    if cfg.task.get("pooling", "cls") != "cls":
        raw["lmkit_pooling"] = cfg.task.pooling  # transformers pools [CLS]; lmkit reads this back
    return raw


def format_rules(fmt: EncoderFormat, cfg: ModelConfig) -> list[Rule]:
    """lmkit Encoder names -> the HF class's names, for the head and pooler of cfg.task."""
    head, pooler = cfg.task.get("head"), cfg.task.get("pooler")
    base = fmt.prefix if head is not None else ""
    out = [rename("encoder.embeddings." + ours, base + hf) for ours, hf in fmt.embeddings
           if not (ours.startswith("token_types") and not cfg.type_vocab_size)]
    out += layer_rules(cfg.n_layers, fmt.layer, "encoder.layers.{i}.", base + fmt.layer_prefix)
    if pooler:
        if head not in fmt.pooler:
            raise ConfigError(f"the {fmt.model_type} format has no pooler for head {head!r}")
        hf = fmt.pooler[head]
        hf = hf[len(fmt.prefix):] if head is None and hf.startswith(fmt.prefix) else hf
        out += [rename(o, h) for o, h in linear("pooler.dense", hf)]
    if head is not None:
        out += [rename(o, h) for o, h in fmt.heads[head]]
        if head in ("mlm", "pretraining") and not cfg.tie_embeddings:
            out.append(rename("mlm_head.decoder.weight", fmt.mlm_decoder))
    return out


def rules(cfg: ModelConfig) -> list[Rule]:
    return format_rules(FORMAT, cfg)


def build_encoder(fmt: EncoderFormat, config: ModelConfig, raw: dict, names=()):
    """An `Encoder` with the head of the HF class in raw["architectures"] (bare with a pooler if none is named).

    names: the checkpoint's tensor names; a bare model whose weights hold no pooler is built without one
    (BertModel(config, add_pooling_layer=False) saves no trace of that flag but its missing tensors)."""
    archs = raw.get("architectures") or [next(iter(fmt.archs))]
    arch = next((a for a in archs if a in fmt.archs), None)
    if arch is None:
        raise ConfigError(f"lmkit does not load {fmt.model_type} class {archs[0]}; supported: {', '.join(fmt.archs)}")
    head, pooler = fmt.archs[arch]
    if head is None and (raw.get("add_pooling_layer") is False
                         or names and not any(n.endswith("pooler.dense.weight") for n in names)):
        pooler = None
    return Encoder(config, head=head, pooler=pooler, num_labels=config.task.get("num_labels", 2),
                   pooling=raw.get("lmkit_pooling", "cls"))


def build(config: ModelConfig, raw: dict, names=()):
    return build_encoder(FORMAT, config, raw, names)


FAMILY = Family(model_types=("bert",), hf_classes=tuple(FORMAT.archs), config_from_hf=config_from_hf,
                config_to_hf=config_to_hf, rules=rules, aliases=ALIASES, build=build)
