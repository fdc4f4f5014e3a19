"""XLNet (XLNetModel, XLNetLMHeadModel, ...ForSequenceClassification/TokenClassification/MultipleChoice/
QuestionAnsweringSimple): config mapping and weight-name table.

XLNet stores each attention projection as one (d_model, n_head, d_head) tensor; the rules split or join the heads.
attn_type "bi" is an lmkit encoder, "uni" a decoder, both with position kind "xl". config.json of transformers 4
(n_token, use_cache) and 5 read alike.
"""
from __future__ import annotations

from lmkit.config import ModelConfig
from lmkit.config_sections import TaskHead
from lmkit.errors import ConfigError
from lmkit.hub.bert import labels_to_hf, num_labels_of, problem_type_of
from lmkit.hub.convert import HF_ACTIVATIONS, Rule, hf_activation, hf_activation_name, layer_rules, rename
from lmkit.hub.family import Family
from lmkit.models.xlnet import XLNet
from lmkit.models.xlnet_heads import SUMMARY_DEFAULTS, summary_settings

MODEL_TYPES = ("xlnet",)
ALIASES = (("transformer.", ""),)
ARCHITECTURES = {"XLNetModel": None, "XLNetLMHeadModel": "lm", "XLNetForSequenceClassification": "sequence",
                 "XLNetForTokenClassification": "token", "XLNetForMultipleChoice": "choice",
                 "XLNetForQuestionAnsweringSimple": "qa"}
# the heads' tensors: lmkit name -> HF name (both absolute)
_HEADS = {None: [], "lm": [("lm_head.bias", "lm_loss.bias")],
          "sequence": [("sequence_summary.summary.weight", "sequence_summary.summary.weight"),
                       ("sequence_summary.summary.bias", "sequence_summary.summary.bias"),
                       ("logits_proj.weight", "logits_proj.weight"), ("logits_proj.bias", "logits_proj.bias")],
          "token": [("classifier.weight", "classifier.weight"), ("classifier.bias", "classifier.bias")],
          "qa": [("qa_outputs.weight", "qa_outputs.weight"), ("qa_outputs.bias", "qa_outputs.bias")]}
_HEADS["choice"] = _HEADS["sequence"]


def _get(hf: dict, *names, default=None):
    return next((hf[n] for n in names if n in hf), default)


def config_from_hf(hf: dict) -> ModelConfig:
    if hf.get("bi_data"):
        raise ConfigError("XLNet bi_data=true (two input directions in one batch, for pre-training) is not reproduced "
                          "by lmkit; set bi_data to false in config.json")
    archs = [a for a in hf.get("architectures") or () if isinstance(a, str)]
    other = [a for a in archs if a not in ARCHITECTURES]
    if other:
        raise ConfigError(f"lmkit does not load XLNet class {other[0]} (XLNetForQuestionAnswering's beam-search "
                          f"answer heads included); supported: {', '.join(ARCHITECTURES)}")
    kind = hf.get("attn_type", "bi")
    if kind not in ("bi", "uni"):
        raise ConfigError(f"XLNet attn_type {kind!r} is not supported; use 'bi' (XLNet) or 'uni' (Transformer-XL)")
    act = hf_activation(hf, "ff_activation", "gelu", HF_ACTIVATIONS, "XLNet")
    d, heads = _get(hf, "d_model", "hidden_size", default=1024), _get(hf, "n_head", "num_attention_heads", default=16)
    if hf.get("d_head") not in (None, d // heads) or d % heads:
        raise ConfigError(f"XLNet needs d_head = d_model / n_head (d_model {d}, n_head {heads}, d_head "
                          f"{hf.get('d_head')}); fix config.json")
    summary = {k: hf.get(k, v) for k, v in SUMMARY_DEFAULTS.items()}
    task = TaskHead(num_labels=num_labels_of(hf), problem_type=problem_type_of(hf), summary=summary)
    extra = {}
    if hf.get("id2label"):
        extra["id2label"] = {str(k): v for k, v in hf["id2label"].items()}
    for key in ("start_n_top", "end_n_top"):
        if key in hf:
            extra[key] = hf[key]
    drop = hf.get("dropout", 0.1)
    config = ModelConfig(
        family="xlnet", architecture="encoder" if kind == "bi" else "decoder", position="xl",
        vocab_size=_get(hf, "vocab_size", "n_token", default=32000), d_model=d,
        n_layers=_get(hf, "n_layer", "num_hidden_layers", default=24), n_heads=heads, d_ff=hf.get("d_inner", 4096),
        max_seq_len=512, norm="layernorm", norm_placement="post", norm_eps=hf.get("layer_norm_eps", 1e-12),
        final_norm=False, activation=HF_ACTIVATIONS[act], bias=True, attention_bias=False, type_vocab_size=0,
        tie_embeddings=hf.get("tie_word_embeddings", True), dropout=drop, attention_dropout=drop,
        activation_dropout=drop, init_std=hf.get("initializer_range", 0.02), clamp_len=hf.get("clamp_len", -1),
        same_length=bool(hf.get("same_length", False)), mem_len=hf.get("mem_len", 512), reuse_len=hf.get("reuse_len"),
        use_mems_eval=bool(hf.get("use_mems_eval", hf.get("use_cache", True))),
        use_mems_train=bool(hf.get("use_mems_train", False)),
        pad_token_id=hf.get("pad_token_id", 5), bos_token_id=hf.get("bos_token_id", 1),
        eos_token_id=hf.get("eos_token_id", 2), task=task, extra=extra)
    summary_settings(config)  # refuse a summary this model cannot build before any weight is read
    return config


def config_to_hf(cfg: ModelConfig) -> dict:
    act = hf_activation_name(cfg.activation, HF_ACTIVATIONS)
    if cfg.position != "xl" or act is None or cfg.norm != "layernorm" or cfg.norm_placement != "post" \
            or cfg.final_norm or cfg.gated or cfg.resolved_n_kv_heads != cfg.n_heads or cfg.resolved_head_dim * cfg.n_heads != cfg.d_model \
            or cfg.type_vocab_size or cfg.n_experts or cfg.embedding_norm:
        raise ConfigError("this model does not fit the XLNet format (needs position 'xl', post-LayerNorm, a plain FFN "
                          "and full multi-head attention of d_model / n_heads per head); save it with family=None")
    head = cfg.task.get("head", "lm")
    arch = next(a for a, h in ARCHITECTURES.items() if h == head)
    summary = {**SUMMARY_DEFAULTS, **cfg.task.get("summary", {})}
    summary["summary_activation"] = summary["summary_activation"] or "linear"  # transformers 5 takes no null
    raw = {"architectures": [arch], "model_type": "xlnet", "vocab_size": cfg.vocab_size, "d_model": cfg.d_model,
           "n_layer": cfg.n_layers, "n_head": cfg.n_heads, "d_head": cfg.resolved_head_dim, "d_inner": cfg.resolved_d_ff,
           "ff_activation": act, "attn_type": "bi" if cfg.architecture == "encoder" else "uni",
           "initializer_range": cfg.init_std, "layer_norm_eps": cfg.norm_eps, "dropout": cfg.dropout,
           "mem_len": cfg.mem_len, "reuse_len": cfg.reuse_len, "use_mems_eval": cfg.use_mems_eval,
           "use_mems_train": cfg.use_mems_train, "bi_data": False, "clamp_len": cfg.clamp_len,
           "same_length": cfg.same_length, "pad_token_id": cfg.pad_token_id, "bos_token_id": cfg.bos_token_id,
           "eos_token_id": cfg.eos_token_id, "tie_word_embeddings": cfg.tie_embeddings, **summary,
           **{k: cfg.extra[k] for k in ("start_n_top", "end_n_top") if k in cfg.extra}, **labels_to_hf(cfg)}
    raw.pop("classifier_dropout")
    return raw


_ATTENTION = "self_attn.sublayer."
_LAYER = [(_ATTENTION + f"{ours}_proj.weight", f"rel_attn.{hf}", True) for ours, hf in
          (("q", "q"), ("k", "k"), ("v", "v"), ("r", "r"))] + [(_ATTENTION + "o_proj.weight", "rel_attn.o", False)] \
    + [(_ATTENTION + n, "rel_attn." + n) for n in ("r_w_bias", "r_r_bias", "r_s_bias", "seg_embed")] \
    + [(f"self_attn.norm.{p}", f"rel_attn.layer_norm.{p}") for p in ("weight", "bias")] \
    + [(f"mlp.norm.{p}", f"ff.layer_norm.{p}") for p in ("weight", "bias")] \
    + [(f"mlp.sublayer.{ours}.{p}", f"ff.{hf}.{p}") for ours, hf in (("up_proj", "layer_1"), ("down_proj", "layer_2"))
       for p in ("weight", "bias")]


def rules(cfg: ModelConfig) -> list[Rule]:
    """lmkit XLNet names -> the HF class's names (a bare XLNetModel's have no "transformer." prefix)."""
    head = cfg.task.get("head", "lm")
    base = "transformer." if head is not None else ""
    out = [rename("transformer.embeddings.tokens.weight", base + "word_embedding.weight"),
           rename("transformer.mask_emb", base + "mask_emb")]
    for rule in layer_rules(cfg.n_layers, _LAYER, "transformer.layers.{i}.", base + "layer.{i}."):
        heads = cfg.n_heads if rule.hf.endswith(("rel_attn.q", "rel_attn.k", "rel_attn.v", "rel_attn.r",
                                                 "rel_attn.o")) else 0
        out.append(Rule(rule.ours, rule.hf, rule.transpose, heads))
    out += [rename(ours, hf) for ours, hf in _HEADS[head]]
    if head == "lm" and not cfg.tie_embeddings:
        out.append(rename("lm_head.weight", "lm_loss.weight"))
    if head in ("sequence", "choice") and not summary_settings(cfg)["summary_use_proj"]:
        out = [r for r in out if not r.hf.startswith("sequence_summary.")]
    return out


def build(config: ModelConfig, raw: dict, names=()):
    """The XLNet of the HF class in raw["architectures"] (XLNetLMHeadModel if none is named)."""

    archs = [a for a in raw.get("architectures") or () if a in ARCHITECTURES] or ["XLNetLMHeadModel"]
    return XLNet(config, head=ARCHITECTURES[archs[0]], num_labels=config.task.get("num_labels", 2))


FAMILY = Family(model_types=MODEL_TYPES, hf_classes=tuple(ARCHITECTURES), config_from_hf=config_from_hf,
                config_to_hf=config_to_hf, rules=rules, aliases=ALIASES, build=build)
