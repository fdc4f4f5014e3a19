"""Encoder inputs and heads beyond the plain forward, against transformers: explicit position ids, label
shapes, folders without BERT's pooler, prepared 4-D masks, multiple choice."""
from __future__ import annotations

import pytest
import torch

import lmkit
from test_encoder import batch, bert_config, distil_config, roberta_config, save_hf

transformers = pytest.importorskip("transformers")


@pytest.mark.parametrize("arch,make", [("BertModel", bert_config), ("RobertaModel", roberta_config),
                                       ("DistilBertModel", distil_config)])
def test_explicit_position_ids_index_the_table_as_transformers_does(tmp_path, arch, make):
    """Given position_ids are table rows as they are: RoBERTa adds no pad + 1 to them (only to its own)."""
    hf = getattr(transformers, arch)(make())
    ours = lmkit.load_model(save_hf(hf, tmp_path))
    ids, mask, _ = batch(hf.config.pad_token_id)
    pos = torch.tensor([[0, 1, 2, 3, 4, 5, 6, 7, 8, 9, 10], [3] * 11, list(range(20, 9, -1))])
    with torch.no_grad():
        ref = hf(input_ids=ids, attention_mask=mask, position_ids=pos).last_hidden_state
        got = ours(input_ids=ids, attention_mask=mask, position_ids=pos).last_hidden_state
    torch.testing.assert_close(got, ref, atol=1e-4, rtol=0)


@pytest.mark.parametrize("arch,make", [("BertForQuestionAnswering", bert_config),
                                       ("RobertaForQuestionAnswering", roberta_config)])
def test_qa_positions_of_shape_batch_by_one(tmp_path, arch, make):
    """start/end positions may come as (B, 1), as transformers squeezes them; past-the-end ones are ignored."""
    hf = getattr(transformers, arch)(make())
    ours = lmkit.load_model(save_hf(hf, tmp_path))
    ids, mask, _ = batch(hf.config.pad_token_id)
    start, end = torch.tensor([[1], [2], [40]]), torch.tensor([[3], [6], [2]])
    with torch.no_grad():
        ref = hf(input_ids=ids, attention_mask=mask, start_positions=start, end_positions=end).loss
        got = ours(input_ids=ids, attention_mask=mask, start_positions=start, end_positions=end).loss
    torch.testing.assert_close(got, ref, atol=1e-5, rtol=0)


@pytest.mark.parametrize("arch,make", [("BertModel", bert_config), ("RobertaModel", roberta_config)])
def test_base_folder_without_pooler_loads_without_one(tmp_path, arch, make):
    """BertModel(config, add_pooling_layer=False) writes no pooler and no flag in config.json: the folder loads
    with no pooler (pooler_output None, as transformers' own model gives) and saves back alike, without one."""
    hf = getattr(transformers, arch)(make(), add_pooling_layer=False)
    ours = lmkit.load_model(save_hf(hf, tmp_path))
    assert ours.pooler is None
    ids, mask, _ = batch(hf.config.pad_token_id)
    with torch.no_grad():
        ref = hf(input_ids=ids, attention_mask=mask)
        got = ours(input_ids=ids, attention_mask=mask)
    assert ref.pooler_output is None and got.pooler_output is None
    torch.testing.assert_close(got.last_hidden_state, ref.last_hidden_state, atol=1e-4, rtol=0)
    ours.save_pretrained(tmp_path / "ours")
    from safetensors.torch import load_file
    assert not any("pooler" in k for k in load_file(tmp_path / "ours" / "model.safetensors"))
    assert lmkit.load_model(tmp_path / "ours").pooler is None
    # transformers builds the same model from lmkit's folder when told so, as from its own
    back, info = getattr(transformers, arch).from_pretrained(tmp_path / "ours", add_pooling_layer=False,
                                                            output_loading_info=True)
    assert back.pooler is None and not info["missing_keys"] and not info["unexpected_keys"]


@pytest.mark.parametrize("arch,make,types", [("BertForMultipleChoice", bert_config, 3),
                                             ("RobertaForMultipleChoice", roberta_config, 1),
                                             ("DistilBertForMultipleChoice", distil_config, 0)])
def test_multiple_choice_matches_transformers_and_round_trips(tmp_path, arch, make, types):
    """Inputs (B, C, T), one score per choice from the pooler: logits (B, C) and the loss as transformers'; the
    folder lmkit saves is the same class again."""
    hf = getattr(transformers, arch)(make())
    ours = lmkit.load_model(save_hf(hf, tmp_path))
    ids, mask, tt = batch(hf.config.pad_token_id, types)
    kwargs = dict(input_ids=ids.view(1, 3, -1).expand(2, 3, -1).contiguous(),
                  attention_mask=mask.view(1, 3, -1).expand(2, 3, -1).contiguous())
    kwargs["input_ids"][1, 0, 1] = 9  # the two questions differ
    if types:
        kwargs["token_type_ids"] = tt.view(1, 3, -1).expand(2, 3, -1).contiguous()
    labels = torch.tensor([2, 0])
    with torch.no_grad():
        ref = hf(**kwargs, labels=labels)
        got = ours(**kwargs, labels=labels)
    assert got.logits.shape == (2, 3)
    torch.testing.assert_close(got.logits, ref.logits, atol=1e-4, rtol=0)
    torch.testing.assert_close(got.loss, ref.loss, atol=1e-5, rtol=0)
    ours.save_pretrained(tmp_path / "ours")
    back = getattr(transformers, arch).from_pretrained(tmp_path / "ours").eval()
    with torch.no_grad():
        torch.testing.assert_close(back(**kwargs).logits, ref.logits, atol=1e-5, rtol=0)


@pytest.mark.parametrize("arch,make", [("BertModel", bert_config), ("DistilBertForSequenceClassification", distil_config)])
def test_prepared_4d_masks_are_used_as_given(tmp_path, arch, make):
    """A (B, 1, T, T) mask goes to attention as it is, as transformers takes it: boolean (here block-diagonal,
    two packed sequences per row) or an additive float bias."""
    hf = getattr(transformers, arch)(make())
    ours = lmkit.load_model(save_hf(hf, tmp_path))
    ids, _, _ = batch(hf.config.pad_token_id)
    segment = (torch.arange(11) >= torch.tensor([4, 6, 9])[:, None]).long()  # (B, T): which packed sequence
    blocks = (segment[:, :, None] == segment[:, None, :])[:, None]
    bias = torch.randn(3, 1, 11, 11, generator=torch.Generator().manual_seed(5))
    for mask in (blocks, bias):
        with torch.no_grad():
            ref, got = hf(input_ids=ids, attention_mask=mask), ours(input_ids=ids, attention_mask=mask)
        name = "logits" if "Classification" in arch else "last_hidden_state"
        torch.testing.assert_close(got[name], getattr(ref, name), atol=1e-4, rtol=0)
    pooled = lmkit.models.encoder.Encoder(ours.config, head="sequence", pooling="mean")
    with pytest.raises(lmkit.errors.ConfigError, match="2-D"):
        pooled(input_ids=ids, attention_mask=blocks)


def test_pretraining_outputs_answer_to_transformers_names(tmp_path):
    """BertForPreTraining's prediction_logits / seq_relationship_logits are there by those names too."""
    hf = transformers.BertForPreTraining(bert_config())
    ours = lmkit.load_model(save_hf(hf, tmp_path))
    ids, mask, tt = batch(0, 3)
    with torch.no_grad():
        ref, got = hf(ids, mask, tt), ours(ids, mask, tt)
    for name in ("prediction_logits", "seq_relationship_logits"):
        torch.testing.assert_close(got[name], ref[name], atol=1e-4, rtol=0)


@pytest.mark.parametrize("act", ["gelu", "gelu_python", "gelu_new", "gelu_pytorch_tanh", "gelu_python_tanh",
                                 "gelu_fast", "gelu_accurate", "relu", "silu", "swish"])
@pytest.mark.parametrize("arch,make,key", [("BertForMaskedLM", bert_config, "hidden_act"),
                                           ("RobertaForMaskedLM", roberta_config, "hidden_act"),
                                           ("DistilBertForMaskedLM", distil_config, "activation")])
def test_every_activation_name_transformers_spells_alike(tmp_path, act, arch, make, key):
    """Each ACT2FN name of GELU (exact or tanh), ReLU and SiLU loads as its function, in the FFN and the MLM
    head (RoBERTa's head stays exact GELU whatever hidden_act says)."""
    hf = getattr(transformers, arch)(make(**{key: act}))
    ours = lmkit.load_model(save_hf(hf, tmp_path))
    ids, mask, _ = batch(hf.config.pad_token_id)
    with torch.no_grad():
        torch.testing.assert_close(ours(ids, attention_mask=mask).logits, hf(ids, attention_mask=mask).logits,
                                   atol=1e-4, rtol=0)


@pytest.mark.parametrize("arch,config_class", [("RobertaForMaskedLM", "RobertaConfig"), ("BertForMaskedLM", "BertConfig"),
                                               ("DistilBertForMaskedLM", "DistilBertConfig")])
def test_keys_left_out_of_config_json_take_the_config_class_defaults(tmp_path, arch, config_class):
    """A hand-trimmed config.json: every key it omits means what the transformers config class defaults to."""
    import json

    sizes = {"RobertaConfig": dict(vocab_size=50265, hidden_size=12, num_hidden_layers=1, num_attention_heads=3,
                                   intermediate_size=10),
             "BertConfig": dict(hidden_size=12, num_hidden_layers=1, num_attention_heads=3, intermediate_size=10),
             "DistilBertConfig": dict(dim=12, n_layers=1, n_heads=3, hidden_dim=10)}[config_class]
    hf = getattr(transformers, arch)(getattr(transformers, config_class)(**sizes))
    path = save_hf(hf, tmp_path)
    (path / "config.json").write_text(json.dumps({"model_type": hf.config.model_type, "architectures": [arch], **sizes}))
    ours = lmkit.load_model(path)
    ids = torch.tensor([[0, 31, 2045, 77, 2, 1, 1]])
    with torch.no_grad():
        ref = getattr(transformers, arch).from_pretrained(path).eval()(ids, attention_mask=(ids != 1).long()).logits
        got = ours(ids, attention_mask=(ids != 1).long()).logits
    torch.testing.assert_close(got, ref, atol=1e-4, rtol=0)


@pytest.mark.parametrize("arch,make,key", [("BertForSequenceClassification", bert_config, "classifier_dropout"),
                                           ("DistilBertForSequenceClassification", distil_config, "seq_classif_dropout")])
def test_classifier_dropout_zero_is_kept(tmp_path, arch, make, key):
    """classifier_dropout 0.0 means no dropout before the classifier (only None falls back to hidden dropout),
    and the value survives save_pretrained."""
    import json

    hidden = {} if "Distil" in arch else {"hidden_dropout_prob": 0.3}  # what the BERT head fell back to
    hf = getattr(transformers, arch)(make(**{key: 0.0, **hidden}))
    ours = lmkit.load_model(save_hf(hf, tmp_path))
    assert ours.dropout.p == hf.dropout.p == 0.0
    ours.save_pretrained(tmp_path / "ours")
    assert json.loads((tmp_path / "ours" / "config.json").read_text())[key] == 0.0
