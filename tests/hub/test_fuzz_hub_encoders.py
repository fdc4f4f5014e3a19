"""Differential fuzz of loading and saving BERT, RoBERTa and DistilBERT folders against transformers.

Hypothesis draws small odd configs (sizes, activations, eps, segment and position tables, pad ids) and inputs
(right and left padding, masks with holes, segments); each model goes transformers -> folder -> lmkit with the
same outputs and losses, a transformers 4.x style config.json of the same weights loads alike, and lmkit's save
loads back in transformers without missing or unexpected tensors.
HUB_FUZZ_EXAMPLES raises the number of examples.
"""
from __future__ import annotations

import json
import os

import pytest
import torch
from hypothesis import HealthCheck, given, note, settings, strategies as st

import lmkit
from lmkit.errors import ConfigError
from tolerances import assert_close_in

transformers = pytest.importorskip("transformers")
transformers.logging.set_verbosity_error()

EXAMPLES = int(os.environ.get("HUB_FUZZ_EXAMPLES", "25"))
FUZZ = settings(max_examples=EXAMPLES, deadline=None, derandomize=EXAMPLES <= 100,
                suppress_health_check=[HealthCheck.too_slow, HealthCheck.function_scoped_fixture,
                                       HealthCheck.data_too_large])
# the activation names transformers accepts that lmkit runs; the others must be refused with a ConfigError
SUPPORTED_ACTS = ("gelu", "gelu_new", "relu", "silu", "swish", "gelu_pytorch_tanh", "gelu_fast", "gelu_accurate",
                  "gelu_python", "gelu_python_tanh", "quick_gelu")
OTHER_ACTS = ("tanh", "sigmoid", "mish", "relu6", "gelu_10", "linear", "leaky_relu")
HEADS = {"bert": ["Model", "ForMaskedLM", "ForPreTraining", "ForNextSentencePrediction", "ForSequenceClassification",
                  "ForTokenClassification", "ForQuestionAnswering", "ForMultipleChoice"],
         "roberta": ["Model", "ForMaskedLM", "ForSequenceClassification", "ForTokenClassification",
                     "ForQuestionAnswering", "ForMultipleChoice"],
         "distilbert": ["Model", "ForMaskedLM", "ForSequenceClassification", "ForTokenClassification",
                        "ForQuestionAnswering", "ForMultipleChoice"]}
MASK_DTYPES = (torch.long, torch.bool, torch.float32, torch.int32)  # attention masks as callers pass them
CLASS = {"bert": "Bert", "roberta": "Roberta", "distilbert": "DistilBert"}
# transformers' output name of each lmkit output name, per head
OUTPUTS = {"Model": ["last_hidden_state", "pooler_output"], "ForMaskedLM": ["logits"],
           "ForPreTraining": [("logits", "prediction_logits"), ("nsp_logits", "seq_relationship_logits")],
           "ForNextSentencePrediction": ["logits"], "ForSequenceClassification": ["logits"],
           "ForTokenClassification": ["logits"], "ForQuestionAnswering": ["start_logits", "end_logits"],
           "ForMultipleChoice": ["logits"]}


@st.composite
def encoder_configs(draw, family=None):
    """(family, head suffix, transformers config) of a small random encoder."""
    family = family or draw(st.sampled_from(sorted(HEADS)))
    head = draw(st.sampled_from(HEADS[family]))
    heads = draw(st.integers(1, 4))
    d = heads * draw(st.integers(1, 7))
    act = draw(st.sampled_from(SUPPORTED_ACTS))
    vocab = draw(st.integers(20, 70))
    common = dict(vocab_size=vocab, tie_word_embeddings=draw(st.booleans()))
    if head in ("ForSequenceClassification", "ForTokenClassification"):
        common["num_labels"] = draw(st.integers(1, 4))
        if head == "ForSequenceClassification":
            common["problem_type"] = draw(st.sampled_from([None, "regression", "single_label_classification",
                                                           "multi_label_classification"]))
            if common["problem_type"] == "single_label_classification":  # transformers refuses one label
                common["num_labels"] = max(common["num_labels"], 2)
    if family == "distilbert":
        cfg = transformers.DistilBertConfig(dim=d, n_layers=draw(st.integers(1, 3)), n_heads=heads,
                                            hidden_dim=draw(st.integers(1, 40)), activation=act,
                                            max_position_embeddings=draw(st.integers(16, 40)), dropout=0.0,
                                            attention_dropout=0.0, pad_token_id=draw(st.integers(0, 5)),
                                            sinusoidal_pos_embds=draw(st.booleans()), **common)
    else:
        pad = draw(st.integers(0, 5))
        n_pos = draw(st.integers(16, 40)) + (pad + 1 if family == "roberta" else 0)
        cfg = getattr(transformers, CLASS[family] + "Config")(
            hidden_size=d, num_hidden_layers=draw(st.integers(1, 3)), num_attention_heads=heads,
            intermediate_size=draw(st.integers(1, 40)), hidden_act=act, max_position_embeddings=n_pos,
            type_vocab_size=draw(st.integers(1, 3)), layer_norm_eps=draw(st.sampled_from([1e-12, 1e-5, 1e-3, 0.1])),
            hidden_dropout_prob=0.0, attention_probs_dropout_prob=0.0, pad_token_id=pad, **common)
    return family, head, cfg


def hf_model(family, head, cfg, seed):
    torch.manual_seed(seed)
    model = getattr(transformers, CLASS[family] + head)(cfg)
    for p in model.parameters():  # nonzero biases and norms, so every tensor's mapping shows
        torch.nn.init.normal_(p, std=0.3)
    return model.eval()


@st.composite
def encoder_inputs(draw, cfg, family, choices=False):
    """Keyword arguments of one random padded batch for this config."""
    batch, length = draw(st.integers(1, 3)), draw(st.integers(1, 12))
    g = torch.Generator().manual_seed(draw(st.integers(0, 2**16)))
    pad = cfg.pad_token_id
    ids = torch.randint(0, cfg.vocab_size, (batch, length), generator=g)
    ids[ids == pad] = (pad + 1) % cfg.vocab_size
    mask = torch.ones_like(ids)
    for row in range(batch):
        side = draw(st.sampled_from(["none", "right", "left", "holes"]))
        n = draw(st.integers(0, length - 1))
        if side == "right" and n:
            mask[row, -n:] = 0
        elif side == "left" and n:
            mask[row, :n] = 0
        elif side == "holes":  # any positions masked, one at least kept
            mask[row] = (torch.rand(length, generator=g) > 0.4).long()
            mask[row, draw(st.integers(0, length - 1))] = 1
    if family != "roberta" or draw(st.booleans()):  # roberta positions skip the pad ids: masked ids stay real
        ids[mask == 0] = pad
    out = dict(input_ids=ids, attention_mask=mask.to(draw(st.sampled_from(MASK_DTYPES))))
    types = getattr(cfg, "type_vocab_size", 0)
    if types and draw(st.booleans()):
        out["token_type_ids"] = torch.randint(0, types, ids.shape, generator=g)
    if choices:
        out = {k: v.unsqueeze(1).expand(-1, 2, -1).contiguous() for k, v in out.items()}
    return out


def labels_for(head, cfg, inputs, g):
    """Labels of the head's loss for a batch (none for heads without one)."""
    ids = inputs["input_ids"]
    B, T = ids.shape[0], ids.shape[-1]
    if head == "ForMaskedLM":
        labels = torch.randint(0, cfg.vocab_size, (B, T), generator=g)
        labels[torch.rand(B, T, generator=g) < 0.5] = -100
        return dict(labels=labels)
    if head == "ForPreTraining":
        return dict(labels=torch.randint(0, cfg.vocab_size, (B, T), generator=g),
                    next_sentence_label=torch.randint(0, 2, (B,), generator=g))
    if head == "ForNextSentencePrediction" or head == "ForMultipleChoice":
        return dict(labels=torch.randint(0, 2, (B,), generator=g))
    if head == "ForSequenceClassification":
        n, kind = cfg.num_labels, cfg.problem_type
        if kind == "regression" or (kind is None and n == 1):
            return dict(labels=torch.randn(B, n, generator=g).squeeze(-1) if n == 1 else torch.randn(B, n, generator=g))
        if kind == "multi_label_classification" or (kind is None and g.initial_seed() % 2):  # float labels: multi
            return dict(labels=torch.randint(0, 2, (B, n), generator=g).float())
        return dict(labels=torch.randint(0, n, (B,), generator=g))
    if head == "ForTokenClassification":
        labels = torch.randint(0, cfg.num_labels, (B, T), generator=g)
        labels[inputs["attention_mask"].reshape(B, T) == 0] = -100
        return dict(labels=labels)
    if head == "ForQuestionAnswering":
        return dict(start_positions=torch.randint(0, T + 2, (B,), generator=g),
                    end_positions=torch.randint(0, T + 2, (B,), generator=g))
    return {}


def compare(ref, got, head, atol=1e-4, both_hf=False):
    """got's outputs (lmkit's, or transformers' with both_hf) within atol of transformers' ref, loss included."""
    for name in OUTPUTS[head]:
        ours, theirs = name if isinstance(name, tuple) else (name, name)
        ours = theirs if both_hf else ours
        expected = getattr(ref, theirs, None)
        if expected is None:
            continue
        value = getattr(got, ours)
        assert value is not None and value.shape == expected.shape, (ours, getattr(value, "shape", None))
        torch.testing.assert_close(value.float(), expected.float(), atol=atol, rtol=0, msg=lambda m: f"{ours}: {m}")
    if getattr(ref, "loss", None) is not None:
        torch.testing.assert_close(got.loss.float(), ref.loss.float(), atol=atol, rtol=1e-5, equal_nan=True,
                                   msg=lambda m: f"loss: {m}")


# config.json entries lmkit's save may change without changing the model: bookkeeping, transformers' defaults
# written out (GPT-2's legacy n_ctx), (DistilBERT) the flag that froze a sinusoidal table that is loaded from the weights anyway, and T5's
# feed_forward_proj spelling ("gated-gelu_new" is written "gated-gelu"; dense_act_fn and is_gated_act, compared, run)
LOSSY = {"transformers_version", "architectures", "dtype", "_name_or_path", "position_embedding_type", "use_cache",
         "label2id", "sinusoidal_pos_embds", "n_positions", "feed_forward_proj", "n_ctx"}


def same_config(folder_a, folder_b, cls):
    """The settings of two folders' config.json as transformers reads them, but for LOSSY ones."""
    from lmkit.hub.convert import HF_ACTIVATIONS

    a, b = (cls.config_class.from_pretrained(f).to_dict() for f in (folder_a, folder_b))
    for key in ("hidden_act", "activation", "activation_function", "dense_act_fn"):  # swish and silu are one
        a[key], b[key] = (HF_ACTIVATIONS.get(x.get(key), x.get(key)) for x in (a, b))
    if a.get("is_encoder_decoder") and a.get("decoder_start_token_id") is None:  # lmkit starts from bos then, as
        b["decoder_start_token_id"] = None if b["decoder_start_token_id"] == b.get("bos_token_id") else -1  # generate
    if a.get("d_model") == 1:  # scaling by sqrt(1) is no scaling
        a.pop("scale_embedding", None), b.pop("scale_embedding", None)
    if a.get("head_dim", 0) is None or ("head_dim" in b and "head_dim" not in a):  # null: hidden / heads
        a["head_dim"] = a["hidden_size"] // a["num_attention_heads"]
    if a.get("model_type") == "gpt2":  # GPT-2: n_inner null is 4 n_embd; scores of one-wide heads divide by sqrt(1)
        a["n_inner"] = a.get("n_inner") or 4 * a["n_embd"]
        if a["n_embd"] == a["n_head"]:
            a.pop("scale_attn_weights"), b.pop("scale_attn_weights")
    diff = {k: (a.get(k), b.get(k)) for k in set(a) | set(b) if k not in LOSSY and a.get(k) != b.get(k)}
    assert not diff, diff


def saved_and_loaded(hf, tmp_path_factory):
    """(folder, lmkit's model) of a transformers model saved as transformers 5 does: float32, in eval mode."""
    folder = tmp_path_factory.mktemp("hf")
    hf.save_pretrained(folder)
    ours = lmkit.load_model(folder)
    assert next(ours.parameters()).dtype == torch.float32 and not ours.training
    return folder, ours


def v4_style(folder):
    """Rewrite a transformers 5 config.json as transformers 4.x wrote it: torch_dtype, a 4.x version."""
    path = folder / "config.json"
    raw = json.loads(path.read_text())
    raw["torch_dtype"] = raw.pop("dtype", "float32")
    raw["transformers_version"] = "4.46.0"
    path.write_text(json.dumps(raw))


@FUZZ
@given(st.data())
def test_encoder_folders_load_and_save_as_transformers(tmp_path_factory, data):
    family, head, cfg = data.draw(encoder_configs())
    note(f"{family}{head} {cfg.to_dict()}")
    hf = hf_model(family, head, cfg, data.draw(st.integers(0, 100)))
    folder, ours = saved_and_loaded(hf, tmp_path_factory)
    inputs = data.draw(encoder_inputs(cfg, family, choices=head == "ForMultipleChoice"))
    inputs.update(labels_for(head, cfg, inputs, torch.Generator().manual_seed(data.draw(st.integers(0, 1)))))
    with torch.no_grad():
        ref = hf(**inputs)
        compare(ref, ours(**inputs), head)
    v4_style(folder)
    with torch.no_grad():
        compare(ref, lmkit.load_model(folder)(**inputs), head)
    out = tmp_path_factory.mktemp("ours")
    ours.save_pretrained(out)
    same_config(folder, out, getattr(transformers, CLASS[family] + head))
    back, info = getattr(transformers, CLASS[family] + head).from_pretrained(out, output_loading_info=True)
    assert not info["missing_keys"] and not info["unexpected_keys"] and not info["mismatched_keys"], info
    with torch.no_grad():
        compare(ref, back.eval()(**inputs), head, both_hf=True)




# --- encoder-decoder formats: T5, mT5, BART, mBART ------------------------------------------------------------------
S2S_CLASS = {"t5": "T5", "mt5": "MT5", "bart": "Bart", "mbart": "MBart"}
T5_PROJ = ("relu", "gelu", "silu", "gelu_new", "gated-gelu", "gated-silu", "gated-relu", "gated-gelu_new")


@st.composite
def seq2seq_configs(draw):
    """(family, "ForConditionalGeneration" or "Model", transformers config) of a small random encoder-decoder."""
    family = draw(st.sampled_from(sorted(S2S_CLASS)))
    head = draw(st.sampled_from(["ForConditionalGeneration", "Model"]))
    heads, vocab = draw(st.integers(1, 4)), draw(st.integers(20, 70))
    tie = draw(st.booleans())
    if family in ("t5", "mt5"):
        cfg = getattr(transformers, S2S_CLASS[family] + "Config")(
            vocab_size=vocab, d_model=draw(st.integers(2, 20)), d_kv=draw(st.integers(1, 7)), num_heads=heads,
            d_ff=draw(st.integers(1, 30)), num_layers=draw(st.integers(1, 3)),
            num_decoder_layers=draw(st.integers(1, 3)), feed_forward_proj=draw(st.sampled_from(T5_PROJ)),
            # fewer than 4 buckets, or a max distance under them, divide by zero in transformers
            relative_attention_num_buckets=(buckets := draw(st.integers(4, 16))),
            relative_attention_max_distance=draw(st.integers(buckets, 30)),
            layer_norm_epsilon=draw(st.sampled_from([1e-6, 1e-3, 0.1])), dropout_rate=0.0, tie_word_embeddings=tie,
            decoder_start_token_id=draw(st.integers(0, 3)), pad_token_id=draw(st.integers(0, 3)))
    else:
        ffn = draw(st.integers(1, 30))
        act = draw(st.sampled_from(SUPPORTED_ACTS))
        cfg = getattr(transformers, S2S_CLASS[family] + "Config")(
            vocab_size=vocab, d_model=heads * draw(st.integers(1, 6)), encoder_layers=draw(st.integers(1, 3)),
            decoder_layers=draw(st.integers(1, 3)), encoder_attention_heads=heads, decoder_attention_heads=heads,
            encoder_ffn_dim=ffn, decoder_ffn_dim=ffn, activation_function=act,
            max_position_embeddings=draw(st.integers(14, 30)), scale_embedding=draw(st.booleans()), dropout=0.0,
            activation_dropout=draw(st.sampled_from([0.0, 0.3])), attention_dropout=0.0, tie_word_embeddings=tie,
            pad_token_id=draw(st.integers(0, 3)), bos_token_id=0, eos_token_id=2,
            decoder_start_token_id=draw(st.sampled_from([None, 2, 5])),
            forced_bos_token_id=draw(st.sampled_from([None, 0])), forced_eos_token_id=draw(st.sampled_from([None, 2])))
    return family, head, cfg


def s2s_model(family, head, cfg, seed):
    torch.manual_seed(seed)
    model = getattr(transformers, S2S_CLASS[family] + head)(cfg)
    with torch.no_grad():
        for name, p in model.named_parameters():
            if "bias" in name or "norm" in name:  # nonzero biases and norms, so every tensor's mapping shows
                p.normal_(0, 0.3)
        if hasattr(model, "final_logits_bias"):
            model.final_logits_bias.normal_(0, 0.3)
    return model.eval()


def padded(draw, g, batch, length, vocab, pad, holes=True):
    """(ids, mask) of a batch padded right, left or (holes) anywhere, one real position per row at least."""
    ids = torch.randint(3, vocab, (batch, length), generator=g)
    mask = torch.ones_like(ids)
    for row in range(batch):
        side = draw(st.sampled_from(["none", "right", "left"] + (["holes"] if holes else [])))
        n = draw(st.integers(0, length - 1))
        if side == "right" and n:
            mask[row, -n:] = 0
        elif side == "left" and n:
            mask[row, :n] = 0
        elif side == "holes":
            mask[row] = (torch.rand(length, generator=g) > 0.4).long()
            mask[row, draw(st.integers(0, length - 1))] = 1
    ids[mask == 0] = pad
    return ids, mask


@st.composite
def seq2seq_inputs(draw, cfg, family):
    g = torch.Generator().manual_seed(draw(st.integers(0, 2**16)))
    batch = draw(st.integers(1, 3))
    ids, mask = padded(draw, g, batch, draw(st.integers(1, 10)), cfg.vocab_size, cfg.pad_token_id)
    out = dict(input_ids=ids, attention_mask=mask.to(draw(st.sampled_from(MASK_DTYPES))))
    dec, dec_mask = padded(draw, g, batch, draw(st.integers(1, 8)), cfg.vocab_size, cfg.pad_token_id)
    # transformers' BART cannot shift labels without a decoder_start_token_id (lmkit starts from bos then)
    shifts = family != "bart" or cfg.decoder_start_token_id is not None
    how = draw(st.sampled_from(["ids", "ids+mask", "ids+labels"] + (["labels"] if shifts else [])))
    if "ids" in how:
        out["decoder_input_ids"] = dec
    if "mask" in how:
        out["decoder_attention_mask"] = dec_mask.to(draw(st.sampled_from(MASK_DTYPES)))
    if "labels" in how:
        labels = dec.clone()
        labels[dec_mask == 0] = -100
        out["labels"] = labels
    return out


def compare_s2s(ref, got, head, atol=1e-4):
    names = ["encoder_last_hidden_state"] + (["logits"] if head == "ForConditionalGeneration" else ["last_hidden_state"])
    for name in names:
        torch.testing.assert_close(getattr(got, name).float(), getattr(ref, name).float(), atol=atol, rtol=1e-4,
                                   msg=lambda m: f"{name}: {m}")
    if getattr(ref, "loss", None) is not None:
        torch.testing.assert_close(got.loss.float(), ref.loss.float(), atol=atol, rtol=1e-4, equal_nan=True,
                                   msg=lambda m: f"loss: {m}")


def v4_style_s2s(folder):
    """transformers 4.x's config.json of the same model: torch_dtype, and T5's scaling said by tie_word_embeddings."""
    v4_style(folder)
    path = folder / "config.json"
    raw = json.loads(path.read_text())
    if "scale_decoder_outputs" in raw:
        raw["tie_word_embeddings"] = raw.pop("scale_decoder_outputs")
    path.write_text(json.dumps(raw))


@FUZZ
@given(st.data())
def test_seq2seq_folders_load_and_save_as_transformers(tmp_path_factory, data):
    family, head, cfg = data.draw(seq2seq_configs())
    note(f"{family}{head} {cfg.to_diff_dict()}")
    hf = s2s_model(family, head, cfg, data.draw(st.integers(0, 100)))
    folder, ours = saved_and_loaded(hf, tmp_path_factory)
    inputs = data.draw(seq2seq_inputs(cfg, family))
    if head == "Model" and "decoder_input_ids" not in inputs:  # the bare model takes no labels
        inputs["decoder_input_ids"] = inputs.pop("labels").clamp(min=0)
    if head == "Model":
        inputs.pop("labels", None)
    with torch.no_grad():
        ref = hf(**inputs, use_cache=False)
        compare_s2s(ref, ours(**inputs), head)
        v4_style_s2s(folder)
        compare_s2s(ref, lmkit.load_model(folder)(**inputs), head)
    out = tmp_path_factory.mktemp("ours")
    ours.save_pretrained(out)
    cls = getattr(transformers, S2S_CLASS[family] + "ForConditionalGeneration")
    same_config(folder, out, cls)
    back, info = cls.from_pretrained(out, output_loading_info=True)
    assert not info["missing_keys"] and not info["unexpected_keys"] and not info["mismatched_keys"], info
    with torch.no_grad():
        compare_s2s(back.eval()(**inputs, use_cache=False), ours(**inputs), "ForConditionalGeneration")


# --- fixed cases the fuzz found or the brief names ------------------------------------------------------------------
def small_seq2seq(name, **kw):
    """A tiny transformers encoder-decoder of class `name`, random but with nonzero norms and biases."""
    if name.startswith(("T5", "MT5")):
        cfg = getattr(transformers, "MT5Config" if name.startswith("MT5") else "T5Config")(
            vocab_size=40, d_model=12, d_kv=5, d_ff=14, num_layers=2, num_decoder_layers=1, num_heads=3,
            dropout_rate=0.0, decoder_start_token_id=0, **kw)
    else:
        cfg = getattr(transformers, "MBartConfig" if name.startswith("MBart") else "BartConfig")(
            vocab_size=40, d_model=12, encoder_layers=1, decoder_layers=2, encoder_attention_heads=3,
            decoder_attention_heads=3, encoder_ffn_dim=14, decoder_ffn_dim=14, max_position_embeddings=30, dropout=0.0,
            **kw)
    torch.manual_seed(0)
    model = getattr(transformers, name)(cfg)
    with torch.no_grad():
        for key, p in model.named_parameters():
            if "bias" in key or "norm" in key:
                p.normal_(0, 0.3)
    return model.eval()


@pytest.mark.parametrize("name", ["T5Model", "MT5Model", "BartModel", "MBartModel"])
@pytest.mark.parametrize("tie", [True, False], ids=["tied", "untied"])
def test_bare_seq2seq_models_give_transformers_last_hidden_state(tmp_path, name, tie):
    """The decoder output of a bare model (T5 v1.0's too, whose head alone reads it times d^-0.5), and an untied
    BartModel, which holds no head, loads."""
    hf = small_seq2seq(name, tie_word_embeddings=tie)
    hf.save_pretrained(tmp_path)
    ours = lmkit.load_model(tmp_path)
    ids = torch.randint(3, 40, (2, 7), generator=torch.Generator().manual_seed(0))
    mask = torch.ones_like(ids)
    mask[1, 5:] = 0
    with torch.no_grad():
        ref, got = hf(input_ids=ids, attention_mask=mask, decoder_input_ids=ids[:, :4]), \
            ours(input_ids=ids, attention_mask=mask, decoder_input_ids=ids[:, :4])
    torch.testing.assert_close(got.last_hidden_state, ref.last_hidden_state, atol=1e-5, rtol=0)
    torch.testing.assert_close(got.encoder_last_hidden_state, ref.encoder_last_hidden_state, atol=1e-5, rtol=0)


def test_untied_bart_saved_by_lmkit_holds_the_stack_tables(tmp_path):
    """transformers 5 gives an untied BART a token table per stack: lmkit's untied BART (one shared table) writes it
    under each stack's name, so transformers loads every tensor and gives lmkit's logits."""
    from lmkit.config import get_preset
    from lmkit.models import build_model

    ours = randomized(build_model(get_preset("bart", vocab_size=30, d_model=8, n_layers=1, n_heads=2, d_ff=10,
                                             max_seq_len=20, tie_embeddings=False)))
    ours.save_pretrained(tmp_path)
    hf, info = transformers.BartForConditionalGeneration.from_pretrained(tmp_path, output_loading_info=True)
    assert not info["missing_keys"] and not info["unexpected_keys"], info
    ids = torch.randint(3, 30, (2, 6), generator=torch.Generator().manual_seed(0))
    with torch.no_grad():
        torch.testing.assert_close(ours(input_ids=ids, decoder_input_ids=ids).logits,
                                   hf.eval()(input_ids=ids, decoder_input_ids=ids).logits, atol=1e-5, rtol=0)


ROUND_TRIPS = [("T5ForConditionalGeneration", dict(bos_token_id=5)), ("MT5ForConditionalGeneration", {}),
               ("BartForConditionalGeneration", dict(forced_eos_token_id=None, forced_bos_token_id=0)),
               ("DistilBertForQuestionAnswering", dict(qa_dropout=0.25))]


@pytest.mark.parametrize("name,fields", ROUND_TRIPS, ids=[r[0] for r in ROUND_TRIPS])
def test_config_json_settings_survive_lmkit_save(tmp_path, name, fields):
    """T5's bos_token_id, DistilBERT's qa_dropout and BART's explicit forced_eos_token_id=null (whose class default
    is 2) come back from lmkit's save, and mT5's config gets no T5-only key."""
    if name.startswith("Distil"):
        hf = hf_model("distilbert", "ForQuestionAnswering", transformers.DistilBertConfig(
            vocab_size=30, dim=8, n_layers=1, n_heads=2, hidden_dim=10, **fields), 0)
    else:
        hf = small_seq2seq(name, **fields)
    hf.save_pretrained(tmp_path / "hf")
    lmkit.load_model(tmp_path / "hf").save_pretrained(tmp_path / "ours")
    same_config(tmp_path / "hf", tmp_path / "ours", getattr(transformers, name))
    if name.startswith("MT5"):
        assert "scale_decoder_outputs" not in json.loads((tmp_path / "ours" / "config.json").read_text())


def test_roberta_mlm_head_of_another_activation_is_refused_on_save(tmp_path):
    """RobertaLMHead runs exact GELU whatever hidden_act says: an lmkit RoBERTa whose MLM head runs ReLU cannot be
    written as one (transformers, and lmkit reading it back, would change its outputs)."""
    from lmkit.config import get_preset
    from lmkit.models.encoder import Encoder

    sizes = dict(vocab_size=30, d_model=8, n_layers=1, n_heads=2, d_ff=10, max_seq_len=20, activation="relu")
    with pytest.raises(ConfigError, match="masked-LM head with exact GELU"):
        Encoder(get_preset("roberta", **sizes), head="mlm").save_pretrained(tmp_path / "relu")
    ours = randomized(Encoder(get_preset("roberta", **sizes, extra={"mlm_activation": "gelu"}), head="mlm"))
    ours.save_pretrained(tmp_path / "gelu")
    ids = torch.randint(3, 30, (2, 6), generator=torch.Generator().manual_seed(0))
    with torch.no_grad():
        torch.testing.assert_close(lmkit.load_model(tmp_path / "gelu")(ids).logits, ours(ids).logits, atol=1e-6, rtol=0)


@pytest.mark.parametrize("name", ["T5EncoderModel", "T5ForSequenceClassification", "T5ForTokenClassification",
                                  "T5ForQuestionAnswering", "BartForSequenceClassification",
                                  "BartForQuestionAnswering", "MBartForSequenceClassification",
                                  "MBartForQuestionAnswering", "BartForCausalLM"])
def test_seq2seq_classes_with_other_heads_are_refused(tmp_path, name):
    """Loading these as a language model would drop their head (or miss the decoder): a one-line ConfigError."""
    small_seq2seq(name).save_pretrained(tmp_path)
    with pytest.raises(ConfigError, match=f"{name} is a .* class lmkit does not load"):
        lmkit.load_model(tmp_path)


PRUNABLE = [("bert", "BertModel", transformers.BertConfig, "attention.self.{}", ("query", "key", "value"),
             "attention.output.dense"),
            ("roberta", "RobertaForSequenceClassification", transformers.RobertaConfig, "attention.self.{}",
             ("query", "key", "value"), "attention.output.dense"),
            ("distilbert", "DistilBertForMaskedLM", transformers.DistilBertConfig, "attention.{}",
             ("q_lin", "k_lin", "v_lin"), "attention.out_lin")]


@pytest.mark.parametrize("family,name,config,qkv,names,out", PRUNABLE, ids=[p[0] for p in PRUNABLE])
def test_folders_with_pruned_heads_load_and_round_trip(tmp_path, family, name, config, qkv, names, out):
    """A transformers 4 folder whose config.json lists pruned_heads (its tensors hold only the kept heads) gives
    the outputs of the unpruned model with those heads' share of the output projection zeroed; lmkit saves it in
    its own format (transformers 5 reads no pruned_heads), recording the pruned heads in the original numbering."""
    sizes = dict(dim=12, n_layers=2, n_heads=3, hidden_dim=10, dropout=0.0, attention_dropout=0.0) \
        if family == "distilbert" else dict(hidden_size=12, num_hidden_layers=2, num_attention_heads=3,
                                            intermediate_size=10, hidden_dropout_prob=0.0,
                                            attention_probs_dropout_prob=0.0)
    hf = hf_model(family, name[len(CLASS[family]):], config(vocab_size=40, max_position_embeddings=24, **sizes), 0)
    hf.save_pretrained(tmp_path / "hf")
    from safetensors.torch import load_file, save_file

    state = load_file(tmp_path / "hf" / "model.safetensors")
    pruned, D = {"1": [0, 2], "0": [1]}, 4
    for layer, heads in pruned.items():
        rows = torch.cat([torch.arange(h * D, (h + 1) * D) for h in range(3) if h not in heads])
        prefix = next(k for k in state if k.endswith(f"layer.{layer}.{qkv.format(names[0])}.weight"))[:-len(
            qkv.format(names[0]) + ".weight")]
        for n in names:
            for w in ("weight", "bias"):
                state[f"{prefix}{qkv.format(n)}.{w}"] = state[f"{prefix}{qkv.format(n)}.{w}"][rows].contiguous()
        state[f"{prefix}{out}.weight"] = state[f"{prefix}{out}.weight"][:, rows].contiguous()
        with torch.no_grad():  # the reference: transformers' unpruned model without those heads' contribution
            for h in heads:
                hf.get_submodule(f"{prefix}{out}").weight[:, h * D:(h + 1) * D] = 0
    save_file(state, tmp_path / "hf" / "model.safetensors", metadata={"format": "pt"})
    raw = json.loads((tmp_path / "hf" / "config.json").read_text())
    (tmp_path / "hf" / "config.json").write_text(json.dumps({**raw, "pruned_heads": pruned}))
    ours = lmkit.load_model(tmp_path / "hf")
    ids = torch.randint(3, 40, (2, 7), generator=torch.Generator().manual_seed(0))
    mask = torch.ones_like(ids)
    mask[1, 5:] = 0
    with torch.no_grad():
        compare(hf(input_ids=ids, attention_mask=mask), ours(input_ids=ids, attention_mask=mask),
                name[len(CLASS[family]):], atol=1e-5)
    ours.save_pretrained(tmp_path / "ours")
    again = lmkit.load_model(tmp_path / "ours")
    assert again.config.compression.pruned_heads == {f"encoder.layers.{i}.self_attn.sublayer": heads
                                                  for i, heads in ((0, [1]), (1, [0, 2]))}
    assert all(torch.equal(a, b) for a, b in zip(ours.state_dict().values(), again.state_dict().values()))


@pytest.mark.parametrize("family,pruned", [("bert", {"5": [0]}), ("distilbert", {"0": [3]}),
                                           ("t5", {"0": [0]}), ("bart", {"0": [0]})])
def test_pruned_heads_lmkit_cannot_load_are_refused(tmp_path, family, pruned):
    """A layer or head the model lacks, or a pruned encoder-decoder: a ConfigError (a layer that lost every head
    loads, as in transformers 4: compress/test_compress.py)."""
    if family in ("t5", "bart"):
        hf = small_seq2seq("T5ForConditionalGeneration" if family == "t5" else "BartForConditionalGeneration")
    else:
        sizes = dict(dim=12, n_layers=1, n_heads=3, hidden_dim=10) if family == "distilbert" else \
            dict(hidden_size=12, num_hidden_layers=1, num_attention_heads=3, intermediate_size=10)
        hf = hf_model(family, "Model", getattr(transformers, CLASS[family] + "Config")(vocab_size=40, **sizes), 0)
    hf.save_pretrained(tmp_path)
    raw = json.loads((tmp_path / "config.json").read_text())
    (tmp_path / "config.json").write_text(json.dumps({**raw, "pruned_heads": pruned}))
    with pytest.raises(ConfigError, match="pruned_heads"):
        lmkit.load_model(tmp_path)


CAST = [("BertForMaskedLM", "bert"), ("RobertaForSequenceClassification", "roberta"),
        ("DistilBertForTokenClassification", "distilbert"), ("T5ForConditionalGeneration", None),
        ("MT5ForConditionalGeneration", None), ("BartForConditionalGeneration", None),
        ("MBartForConditionalGeneration", None)]


@pytest.mark.bf16
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16], ids=["bf16", "fp16"])
@pytest.mark.parametrize("name,family", CAST, ids=[c[0] for c in CAST])
def test_half_precision_folders_load_in_their_dtype(tmp_path, name, family, dtype):
    """dtype="auto" loads a bf16 / fp16 folder in that dtype with transformers' dtype="auto" outputs (within a few
    steps of the format at the largest logit: both round each op), no dtype loads float32, and lmkit's save of the
    half model stays in that dtype."""
    if family:
        sizes = dict(dim=12, n_layers=2, n_heads=3, hidden_dim=10) if family == "distilbert" else \
            dict(hidden_size=12, num_hidden_layers=2, num_attention_heads=3, intermediate_size=10,
                 max_position_embeddings=24)
        hf = hf_model(family, name[len(CLASS[family]):], getattr(transformers, CLASS[family] + "Config")(
            vocab_size=40, num_labels=3, **sizes), 0)
    else:
        hf = small_seq2seq(name)
    hf.to(dtype).save_pretrained(tmp_path / "hf")
    ref = getattr(transformers, name).from_pretrained(tmp_path / "hf", dtype="auto").eval()
    ours = lmkit.load_model(tmp_path / "hf", dtype="auto")
    assert next(ref.parameters()).dtype == next(ours.parameters()).dtype == dtype
    assert next(lmkit.load_model(tmp_path / "hf").parameters()).dtype == torch.float32
    ids = torch.randint(3, 40, (2, 7), generator=torch.Generator().manual_seed(0))
    mask = torch.ones_like(ids)
    mask[1, 5:] = 0
    kw = dict(input_ids=ids, attention_mask=mask) | ({} if family else dict(decoder_input_ids=ids[:, :5]))
    with torch.no_grad():
        a, b = ref(**kw).logits.float(), ours(**kw).logits
    assert b.dtype == dtype
    assert_close_in(dtype, b, a, steps=4)
    ours.save_pretrained(tmp_path / "ours")
    assert json.loads((tmp_path / "ours" / "config.json").read_text())["dtype"] == str(dtype).removeprefix("torch.")
    back = getattr(transformers, name).from_pretrained(tmp_path / "ours", dtype="auto")
    assert next(back.parameters()).dtype == dtype
    v4_style(tmp_path / "hf")  # transformers 4 named it torch_dtype
    assert next(lmkit.load_model(tmp_path / "hf", dtype="auto").parameters()).dtype == dtype


@settings(FUZZ, max_examples=max(EXAMPLES // 2, 4))
@given(st.data())
def test_unsupported_activations_are_refused(tmp_path_factory, data):
    """Every activation transformers runs that lmkit lacks is a one-line ConfigError, in every family."""
    act = data.draw(st.sampled_from(OTHER_ACTS))
    if data.draw(st.booleans()):
        family, head, cfg = data.draw(encoder_configs())
        setattr(cfg, "activation" if family == "distilbert" else "hidden_act", act)
        model = hf_model(family, head, cfg, 0)
    else:
        family, head, cfg = data.draw(seq2seq_configs())
        if family in ("t5", "mt5"):
            cfg.feed_forward_proj = data.draw(st.sampled_from([act, f"gated-{act}"]))
            cfg.dense_act_fn, cfg.is_gated_act = act, cfg.feed_forward_proj.startswith("gated")
        else:
            cfg.activation_function = act
        model = s2s_model(family, head, cfg, 0)
    folder = tmp_path_factory.mktemp("act")
    model.save_pretrained(folder)
    with pytest.raises(ConfigError, match="not supported"):
        lmkit.load_model(folder)


# --- lmkit's own models -> transformers -------------------------------------------------------------------------------
NATIVE_HEADS = {"bert": [None, "mlm", "pretraining", "nsp", "sequence", "token", "qa", "choice"],
                "roberta": [None, "mlm", "sequence", "token", "qa", "choice"],
                "distilbert": [None, "mlm", "sequence", "token", "qa", "choice"]}
HEAD_CLASS = {None: "Model", "mlm": "ForMaskedLM", "pretraining": "ForPreTraining",
              "nsp": "ForNextSentencePrediction", "sequence": "ForSequenceClassification",
              "token": "ForTokenClassification", "qa": "ForQuestionAnswering", "choice": "ForMultipleChoice"}
LMKIT_ACTS = ("gelu", "gelu_tanh", "relu", "silu")


def randomized(model):
    torch.manual_seed(0)
    with torch.no_grad():
        for p in model.parameters():
            p.normal_(0, 0.3)
        for name, b in model.named_buffers():
            if name.endswith("final_logits_bias"):
                b.normal_(0, 0.3)
    return model.eval()


@st.composite
def native_models(draw):
    """(transformers class name, an lmkit model built from a preset with random sizes) of every savable family."""
    from lmkit.config import get_preset
    from lmkit.models import build_model
    from lmkit.models.encoder import Encoder

    family = draw(st.sampled_from(["bert", "roberta", "distilbert", "t5", "mt5", "bart", "mbart"]))
    heads = draw(st.integers(1, 4))
    sizes = dict(vocab_size=draw(st.integers(20, 60)), n_layers=draw(st.integers(1, 3)), n_heads=heads,
                 d_ff=draw(st.integers(1, 30)), dropout=0.0, attention_dropout=0.0, max_seq_len=draw(st.integers(14, 30)))
    if family in ("bert", "roberta", "distilbert"):
        pad = draw(st.integers(0, 4))
        sizes.update(d_model=heads * draw(st.integers(1, 6)), activation=draw(st.sampled_from(LMKIT_ACTS)),
                     tie_embeddings=draw(st.booleans()), pad_token_id=pad)
        if family == "bert":
            sizes.update(type_vocab_size=draw(st.integers(1, 3)), norm_eps=draw(st.sampled_from([1e-12, 1e-3])))
        if family == "roberta":
            sizes.update(position_offset=pad + 1, norm_eps=draw(st.sampled_from([1e-5, 1e-3])))
        head = draw(st.sampled_from(NATIVE_HEADS[family]))
        n = draw(st.integers(1, 4)) if head in ("sequence", "token") else 2
        pooler = "relu" if family == "distilbert" and head in ("sequence", "choice") else None
        if family == "roberta" and draw(st.booleans()):  # RobertaLMHead's GELU, whatever the stack runs
            sizes["extra"] = {"mlm_activation": "gelu"}
        model = Encoder(get_preset(family, **sizes), head=head, num_labels=n,
                        **({"pooler": pooler} if pooler else {}))
        return CLASS[family] + HEAD_CLASS[head], randomized(model)
    if family in ("t5", "mt5"):
        gated = draw(st.booleans())
        tied = family == "t5" and draw(st.booleans())
        d = draw(st.integers(2, 20))
        cfg = get_preset("t5", **sizes, d_model=d, head_dim=draw(st.integers(1, 6)), family=family,
                         n_decoder_layers=draw(st.integers(1, 3)), tie_embeddings=tied,
                         output_scale=d ** -0.5 if tied else 1.0,
                         activation=draw(st.sampled_from(("geglu", "geglu_tanh", "swiglu", "reglu") if gated
                                                         else LMKIT_ACTS)),
                         relative_buckets=(b := draw(st.integers(4, 12))),
                         relative_max_distance=draw(st.integers(b, 30)))
        return ("MT5" if family == "mt5" else "T5") + "ForConditionalGeneration", randomized(build_model(cfg))
    layout = dict(norm_placement="pre", final_norm=True, decoder_start_from_labels=True) if family == "mbart" else {}
    d = heads * draw(st.integers(1, 6))
    cfg = get_preset("bart", **sizes, **layout, d_model=d, family=family,
                     n_decoder_layers=draw(st.integers(1, 3)), activation=draw(st.sampled_from(LMKIT_ACTS)),
                     tie_embeddings=draw(st.booleans()), embedding_scale=draw(st.sampled_from([1.0, d ** 0.5])))
    return S2S_CLASS[family] + "ForConditionalGeneration", randomized(build_model(cfg))


@FUZZ
@given(st.data())
def test_lmkit_models_save_folders_transformers_loads(tmp_path_factory, data):
    """An lmkit model of any savable family and head, saved, loads in transformers' class without missing or
    unexpected tensors and gives lmkit's outputs."""
    name, ours = data.draw(native_models())
    note(f"{name} {ours.config}")
    folder = tmp_path_factory.mktemp("native")
    if name == "RobertaForMaskedLM" and ours.config.task.get("mlm_activation", ours.config.activation) != "gelu":
        with pytest.raises(ConfigError, match="masked-LM head with exact GELU"):
            ours.save_pretrained(folder)
        return
    ours.save_pretrained(folder)
    assert json.loads((folder / "config.json").read_text())["architectures"] == [name]
    # a bare encoder without pooler is built so in transformers by an argument (the folder lacks its tensors)
    kw = {"add_pooling_layer": False} if name in ("BertModel", "RobertaModel") and ours.pooler is None else {}
    hf, info = getattr(transformers, name).from_pretrained(folder, output_loading_info=True, **kw)
    assert not info["missing_keys"] and not info["unexpected_keys"] and not info["mismatched_keys"], info
    cfg = hf.config
    if hf.config.is_encoder_decoder:
        inputs = data.draw(seq2seq_inputs(cfg, "mbart" if "MBart" in name else "t5"))
        if "decoder_input_ids" not in inputs:
            inputs["decoder_input_ids"] = inputs.pop("labels").clamp(min=0)
        with torch.no_grad():
            compare_s2s(hf.eval()(**inputs, use_cache=False), ours(**inputs), "ForConditionalGeneration")
        return
    family = {"Bert": "bert", "Roberta": "roberta", "DistilBert": "distilbert"}[name[:name.index("For")]
                                                                                if "For" in name else name[:-5]]
    head = name[len(CLASS[family]):]
    inputs = data.draw(encoder_inputs(cfg, family, choices=head == "ForMultipleChoice"))
    inputs.update(labels_for(head, cfg, inputs, torch.Generator().manual_seed(data.draw(st.integers(0, 1)))))
    with torch.no_grad():
        compare(hf.eval()(**inputs), ours(**inputs), head)
