"""Encoder models (BERT, RoBERTa, DistilBERT) against transformers on small random models of odd shapes."""
from __future__ import annotations

import json

import pytest
import torch

import lmkit
from lmkit.config import get_preset
from lmkit.errors import ConfigError
from lmkit.models.encoder import Encoder, padding_skipping_positions
from lmkit.models.heads import pool

transformers = pytest.importorskip("transformers")

ODD = dict(vocab_size=101, hidden_size=36, num_hidden_layers=2, num_attention_heads=3, intermediate_size=52,
           max_position_embeddings=40, hidden_dropout_prob=0.0, attention_probs_dropout_prob=0.0)


def bert_config(**kw):
    return transformers.BertConfig(**{**ODD, "type_vocab_size": 3, **kw})


def roberta_config(**kw):
    return transformers.RobertaConfig(**{**ODD, "max_position_embeddings": 42, "type_vocab_size": 1,
                                         "pad_token_id": 1, "bos_token_id": 0, "eos_token_id": 2, **kw})


def distil_config(**kw):
    return transformers.DistilBertConfig(vocab_size=101, dim=36, n_layers=2, n_heads=3, hidden_dim=52,
                                         max_position_embeddings=40, dropout=0.0, attention_dropout=0.0, **kw)


def batch(pad_id, types=1, seed=0):
    g = torch.Generator().manual_seed(seed)
    ids = torch.randint(3, 101, (3, 11), generator=g)
    mask = torch.ones_like(ids)
    mask[1, 7:] = 0
    mask[2, 3:] = 0
    ids[mask == 0] = pad_id
    token_types = torch.zeros_like(ids)
    if types > 1:
        token_types[:, 5:] = 1
        token_types[0, 9:] = types - 1
    return ids, mask, token_types


def save_hf(model, tmp_path, name="hf"):
    torch.manual_seed(0)
    for p in model.parameters():  # nonzero biases and norms, so every tensor's mapping matters
        torch.nn.init.normal_(p, std=0.2)
    model.eval()
    path = tmp_path / name
    model.save_pretrained(path)
    return path


CASES = [
    ("BertModel", bert_config, 3), ("BertForMaskedLM", bert_config, 3), ("BertForPreTraining", bert_config, 3),
    ("BertForSequenceClassification", bert_config, 3), ("BertForTokenClassification", bert_config, 3),
    ("BertForQuestionAnswering", bert_config, 3), ("BertForNextSentencePrediction", bert_config, 3),
    ("RobertaModel", roberta_config, 1), ("RobertaForMaskedLM", roberta_config, 1),
    ("RobertaForSequenceClassification", roberta_config, 1), ("RobertaForTokenClassification", roberta_config, 1),
    ("RobertaForQuestionAnswering", roberta_config, 1),
    ("DistilBertModel", distil_config, 0), ("DistilBertForMaskedLM", distil_config, 0),
    ("DistilBertForSequenceClassification", distil_config, 0), ("DistilBertForQuestionAnswering", distil_config, 0),
    ("DistilBertForTokenClassification", distil_config, 0),
]


def outputs(out, arch):
    """The tensors a class returns, by name, for transformers' and lmkit's outputs alike."""
    if arch.endswith("Model"):
        names = ["last_hidden_state"] + (["pooler_output"] if "Distil" not in arch else [])
    elif arch.endswith("QuestionAnswering"):
        names = ["start_logits", "end_logits"]
    elif arch.endswith("PreTraining"):
        names = ["logits", "nsp_logits"]
    else:
        names = ["logits"]
    hf_names = {"logits": "prediction_logits" if arch.endswith("PreTraining") else "logits",
                "nsp_logits": "seq_relationship_logits"}
    return {n: getattr(out, n if not hasattr(out, "config") else n) for n in names}, hf_names


@pytest.mark.parametrize("arch,make,types", CASES, ids=[c[0] for c in CASES])
def test_matches_transformers(tmp_path, arch, make, types):
    kw = {"num_labels": 5} if "Classification" in arch else {}
    hf = getattr(transformers, arch)(make(**kw))
    path = save_hf(hf, tmp_path)
    ours = lmkit.load_model(path)
    assert isinstance(ours, Encoder) and not ours.training
    pad = hf.config.pad_token_id
    ids, mask, tt = batch(pad, types)
    kwargs = dict(input_ids=ids, attention_mask=mask)
    if types:
        kwargs["token_type_ids"] = tt
    with torch.no_grad():
        ref = hf(**kwargs)
        got = ours(**kwargs)
    names, hf_names = outputs(got, arch)
    for name, value in names.items():
        expected = getattr(ref, hf_names.get(name, name))
        assert value is not None and value.shape == expected.shape, name
        torch.testing.assert_close(value, expected, atol=1e-4, rtol=0, msg=f"{arch} {name}")


@pytest.mark.parametrize("arch,make,types", CASES, ids=[c[0] for c in CASES])
def test_save_roundtrip_loads_in_transformers(tmp_path, arch, make, types):
    kw = {"num_labels": 5} if "Classification" in arch else {}
    hf = getattr(transformers, arch)(make(**kw))
    ours = lmkit.load_model(save_hf(hf, tmp_path))
    ours.save_pretrained(tmp_path / "ours")
    raw = json.loads((tmp_path / "ours" / "config.json").read_text())
    assert raw["architectures"] == [arch]
    back = getattr(transformers, arch).from_pretrained(tmp_path / "ours").eval()
    ids, mask, tt = batch(hf.config.pad_token_id, types, seed=1)
    kwargs = dict(input_ids=ids, attention_mask=mask)
    if types:
        kwargs["token_type_ids"] = tt
    with torch.no_grad():
        a, b = hf(**kwargs), back(**kwargs)
    for key in ("last_hidden_state", "logits", "prediction_logits", "start_logits"):
        if getattr(a, key, None) is not None:
            torch.testing.assert_close(a[key], b[key], atol=1e-5, rtol=0)
    again = lmkit.load_model(tmp_path / "ours")
    for (k1, v1), (k2, v2) in zip(ours.state_dict().items(), again.state_dict().items()):
        assert k1 == k2 and torch.equal(v1, v2)


@pytest.mark.parametrize("arch,make,bias", [("BertForMaskedLM", bert_config, "cls.predictions"),
                                             ("RobertaForMaskedLM", roberta_config, "lm_head")])
def test_untied_mlm_and_single_bias_name(tmp_path, arch, make, bias):
    """An untied decoder travels as its own tensor (with the decoder's own bias, which transformers uses);
    a checkpoint holding only one of the two bias names (tied, older versions) loads too."""
    hf = getattr(transformers, arch)(make(tie_word_embeddings=False))
    path = save_hf(hf, tmp_path)
    ours = lmkit.load_model(path)
    assert ours.mlm_head.decoder.weight.data_ptr() != ours.encoder.embeddings.tokens.weight.data_ptr()
    pad = hf.config.pad_token_id
    ids, mask, _ = batch(pad)
    with torch.no_grad():
        torch.testing.assert_close(ours(ids, mask).logits, hf(ids, mask).logits, atol=1e-4, rtol=0)
    from safetensors.torch import load_file, save_file
    tensors = load_file(path / "model.safetensors")
    tensors.pop(f"{bias}.bias")
    save_file(tensors, path / "model.safetensors")
    with torch.no_grad():
        torch.testing.assert_close(lmkit.load_model(path)(ids, mask).logits, hf(ids, mask).logits, atol=1e-4, rtol=0)


def test_preset_encoders_tie_mlm_head_to_embeddings():
    for name in ("bert", "roberta", "distilbert"):
        cfg = get_preset(name, vocab_size=97, d_model=32, n_layers=1, n_heads=4, d_ff=40, max_seq_len=16)
        model = lmkit.build_model(cfg)
        assert isinstance(model, Encoder) and model.head == "mlm"
        assert model.mlm_head.decoder.weight is model.encoder.embeddings.tokens.weight
        out = model(torch.randint(3, 97, (2, 7)))
        assert out.logits.shape == (2, 7, 97)


def test_padding_does_not_change_real_positions():
    """Hidden states of real tokens are the same with and without trailing padding (BERT and RoBERTa)."""
    for name in ("bert", "roberta"):
        cfg = get_preset(name, vocab_size=97, d_model=32, n_layers=2, n_heads=4, d_ff=40, max_seq_len=24, dropout=0.0,
                         attention_dropout=0.0)
        model = Encoder(cfg, head=None).eval()
        ids = torch.randint(3, 97, (1, 9))
        padded = torch.cat([ids, torch.full((1, 4), cfg.pad_token_id)], dim=1)
        mask = (padded != cfg.pad_token_id).long()
        with torch.no_grad():
            a = model(ids).last_hidden_state
            b = model(padded, attention_mask=mask).last_hidden_state[:, :9]
        torch.testing.assert_close(a, b, atol=1e-5, rtol=0)


def test_roberta_positions_skip_padding():
    pad = 1
    ids = torch.tensor([[0, 5, 6, 2, pad, pad], [pad, pad, 0, 7, 8, 2]])
    pos = padding_skipping_positions(ids, pad)
    assert pos.tolist() == [[0, 1, 2, 3, -1, -1], [-1, -1, 0, 1, 2, 3]]
    # with offset pad + 1 the table row of a pad is padding_idx, as in transformers
    assert ((pos + pad + 1)[ids == pad] == pad).all()


def test_mean_pooling_ignores_padding():
    h = torch.randn(2, 5, 4)
    mask = torch.tensor([[1, 1, 1, 0, 0], [1, 1, 1, 1, 1]])
    torch.testing.assert_close(pool(h, mask, "mean")[0], h[0, :3].mean(0))
    torch.testing.assert_close(pool(h, mask, "mean")[1], h[1].mean(0))
    torch.testing.assert_close(pool(h, mask, "cls"), h[:, 0])


def test_heads_losses():
    cfg = get_preset("bert", vocab_size=50, d_model=16, n_layers=1, n_heads=2, d_ff=20, max_seq_len=12, dropout=0.0)
    ids = torch.randint(3, 50, (2, 6))
    seq = Encoder(cfg, head="sequence", num_labels=3, pooling="mean")
    out = seq(ids, labels=torch.tensor([0, 2]))
    assert out.logits.shape == (2, 3)
    torch.testing.assert_close(out.loss, torch.nn.functional.cross_entropy(out.logits, torch.tensor([0, 2])))
    reg = Encoder(cfg, head="sequence", num_labels=1)
    out = reg(ids, labels=torch.tensor([0.5, -1.0]))
    torch.testing.assert_close(out.loss, ((out.logits.squeeze(-1) - torch.tensor([0.5, -1.0])) ** 2).mean())
    qa = Encoder(cfg, head="qa")
    out = qa(ids, start_positions=torch.tensor([1, 2]), end_positions=torch.tensor([3, 4]))
    assert out.start_logits.shape == (2, 6)
    ce = torch.nn.functional.cross_entropy
    expected = (ce(out.start_logits, torch.tensor([1, 2])) + ce(out.end_logits, torch.tensor([3, 4]))) / 2
    torch.testing.assert_close(out.loss, expected)  # transformers' QA loss: mean of start and end CE
    pre = Encoder(cfg, head="pretraining")
    labels = torch.full_like(ids, -100)
    labels[0, 2] = 7
    out = pre(ids, labels=labels, next_sentence_label=torch.tensor([0, 1]))
    mlm = torch.nn.functional.cross_entropy(out.logits[0, 2][None], torch.tensor([7]))
    nsp = torch.nn.functional.cross_entropy(out.nsp_logits, torch.tensor([0, 1]))
    torch.testing.assert_close(out.loss, mlm + nsp)


def test_user_errors(tmp_path):
    cfg = get_preset("bert", vocab_size=50, d_model=16, n_layers=1, n_heads=2, d_ff=20, max_seq_len=12)
    with pytest.raises(ConfigError, match="head"):
        Encoder(cfg, head="translation")
    with pytest.raises(ConfigError, match="pooler"):
        Encoder(cfg, head="sequence", pooler=None)
    model = Encoder(get_preset("roberta", vocab_size=50, d_model=16, n_layers=1, n_heads=2, d_ff=20, max_seq_len=12))
    model.config.family = "bert"
    with pytest.raises(ConfigError, match="roberta"):
        model.save_pretrained(tmp_path / "x")
    # what the format cannot hold is the config's one-line error, not a missing weight name (a KeyError)
    model = Encoder(get_preset("bert", vocab_size=50, d_model=16, n_layers=1, n_heads=2, d_ff=20, bias=False))
    with pytest.raises(ConfigError, match="does not fit the bert format"):
        model.save_pretrained(tmp_path / "y")


def test_lmkit_native_format_keeps_head(tmp_path):
    cfg = get_preset("bert", vocab_size=50, d_model=16, n_layers=1, n_heads=2, d_ff=20, max_seq_len=12, family=None)
    model = Encoder(cfg, head="token", num_labels=4).eval()
    model.save_pretrained(tmp_path / "m")
    again = lmkit.load_model(tmp_path / "m")
    assert again.head == "token" and again.num_labels == 4
    ids = torch.randint(3, 50, (2, 6))
    torch.testing.assert_close(model(ids).logits, again(ids).logits)


def test_unsupported_class_and_position_type_are_user_errors(tmp_path):
    hf = transformers.BertModel(bert_config())
    path = save_hf(hf, tmp_path)
    raw = json.loads((path / "config.json").read_text())
    (path / "config.json").write_text(json.dumps({**raw, "architectures": ["BertLMHeadModel"]}))
    with pytest.raises(ConfigError, match="BertLMHeadModel"):
        lmkit.load_model(path)
    (path / "config.json").write_text(json.dumps({**raw, "position_embedding_type": "relative_key"}))
    with pytest.raises(ConfigError, match="absolute"):
        lmkit.load_model(path)


def test_transformers_4_style_config(tmp_path):
    """A config.json as transformers 4.x wrote it (torch_dtype, gradient_checkpointing, no dtype) loads the same."""
    hf = transformers.BertForMaskedLM(bert_config())
    path = save_hf(hf, tmp_path)
    raw = json.loads((path / "config.json").read_text())
    raw.pop("dtype", None)
    raw.update(torch_dtype="float32", transformers_version="4.30.2", gradient_checkpointing=False,
               position_embedding_type="absolute", use_cache=True)
    (path / "config.json").write_text(json.dumps(raw))
    ids, mask, tt = batch(0, 3)
    with torch.no_grad():
        torch.testing.assert_close(lmkit.load_model(path)(ids, mask, tt).logits, hf(ids, mask, tt).logits,
                                   atol=1e-4, rtol=0)


@pytest.mark.parametrize("arch,make", [("BertModel", bert_config), ("RobertaModel", roberta_config),
                                       ("DistilBertModel", distil_config)])
def test_inputs_embeds_get_positions_segments_and_norm(tmp_path, arch, make):
    """inputs_embeds replace only the token lookup: positions (RoBERTa's from pad + 1), segments and the
    embedding LayerNorm still apply, as in transformers."""
    hf = getattr(transformers, arch)(make())
    ours = lmkit.load_model(save_hf(hf, tmp_path))
    ids, mask, _ = batch(hf.config.pad_token_id)
    embeds = torch.randn(*ids.shape, 36, generator=torch.Generator().manual_seed(3))
    with torch.no_grad():
        ref = hf(inputs_embeds=embeds, attention_mask=mask).last_hidden_state
        got = ours(inputs_embeds=embeds, attention_mask=mask).last_hidden_state
    torch.testing.assert_close(got, ref, atol=1e-4, rtol=0)


@pytest.mark.parametrize("arch,make", [("BertForSequenceClassification", bert_config),
                                       ("RobertaForSequenceClassification", roberta_config),
                                       ("DistilBertForSequenceClassification", distil_config)])
@pytest.mark.parametrize("problem_type,num_labels,float_labels", [
    (None, 4, True), ("multi_label_classification", 4, True), ("regression", 3, True),
    ("single_label_classification", 4, False), (None, 1, True)])
def test_sequence_loss_follows_problem_type(tmp_path, arch, make, problem_type, num_labels, float_labels):
    """The loss transformers picks: problem_type from config.json, else MSE for one label, cross-entropy for
    integer labels, BCE-with-logits (multi-label) for float labels; problem_type survives the round trip."""
    hf = getattr(transformers, arch)(make(num_labels=num_labels, problem_type=problem_type))
    ours = lmkit.load_model(save_hf(hf, tmp_path))
    ids, mask, _ = batch(hf.config.pad_token_id)
    g = torch.Generator().manual_seed(4)
    if not float_labels:
        labels = torch.randint(0, num_labels, (3,), generator=g)
    elif problem_type == "regression" or num_labels == 1:
        labels = torch.randn(3, num_labels, generator=g).squeeze(-1)
    else:
        labels = (torch.rand(3, num_labels, generator=g) > 0.5).float()
    with torch.no_grad():
        ref = hf(input_ids=ids, attention_mask=mask, labels=labels).loss
        got = ours(input_ids=ids, attention_mask=mask, labels=labels).loss
    torch.testing.assert_close(got, ref, atol=1e-5, rtol=1e-5)
    ours.save_pretrained(tmp_path / "ours")
    assert json.loads((tmp_path / "ours" / "config.json").read_text()).get("problem_type") == problem_type


def test_unknown_problem_type_is_a_config_error(tmp_path):
    path = save_hf(transformers.BertForSequenceClassification(bert_config()), tmp_path)
    raw = json.loads((path / "config.json").read_text())
    raw["problem_type"] = "ranking"
    (path / "config.json").write_text(json.dumps(raw))
    with pytest.raises(ConfigError, match="problem_type 'ranking'"):
        lmkit.load_model(path)
