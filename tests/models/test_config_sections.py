"""ModelConfig's typed settings for task heads, compression, routing and per-stack embeddings: given under their
config.json keys in `extra` or as fields, they land in the typed fields, change the model they build, and
serialize back under the same keys; `extra` keeps only what passes through."""
import pytest
import torch

from lmkit import ModelConfig
from lmkit.config import get_preset
from lmkit.config_sections import UNSET, Compression, TaskHead
from lmkit.errors import ConfigError
from lmkit.models import build_model
from lmkit.models.encoder import Encoder

SMALL = dict(vocab_size=40, d_model=16, n_layers=1, n_heads=2, max_seq_len=16)


def test_extra_keys_move_to_typed_fields_and_serialize_back():
    cfg = get_preset("bert", **SMALL, extra={"head": "sequence", "num_labels": 3, "classifier_dropout": None,
                                             "router_jitter_noise": 0.25, "pruned_heads": {"x": [1]},
                                             "id2label": {"0": "a"}, "note": [1, 2]})
    assert cfg.task == TaskHead(head="sequence", num_labels=3, classifier_dropout=None)
    assert cfg.compression == Compression(pruned_heads={"x": [1]})
    assert cfg.router_jitter_noise == 0.25
    assert cfg.extra == {"id2label": {"0": "a"}, "note": [1, 2]}
    saved = cfg.to_dict()
    assert saved["extra"] == {"head": "sequence", "num_labels": 3, "classifier_dropout": None,
                              "router_jitter_noise": 0.25, "pruned_heads": {"x": [1]}, "id2label": {"0": "a"},
                              "note": [1, 2]}
    assert not {"task", "compression", "router_jitter_noise"} & set(saved)
    assert ModelConfig.from_dict(saved) == cfg


def test_unset_is_told_from_an_explicit_null():
    bare = Encoder(get_preset("bert", **SMALL), head=None)
    assert bare.config.task.head is None and bare.config.to_dict()["extra"]["head"] is None
    assert get_preset("bert", **SMALL).task.head is UNSET and "head" not in get_preset("bert", **SMALL).to_dict()["extra"]
    assert Encoder(get_preset("bert", **SMALL)).head == "mlm"  # unset: the class's default


def test_typed_fields_change_the_model():
    torch.manual_seed(0)
    ids = torch.randint(0, 40, (2, 7))
    cfg = get_preset("bert", **SMALL, dropout=0.0, attention_dropout=0.0)
    exact = Encoder(cfg.replace(task=TaskHead(mlm_activation="gelu"))).eval()
    tanh = Encoder(cfg.replace(task=TaskHead(mlm_activation="gelu_tanh"))).eval()
    tanh.load_state_dict(exact.state_dict())
    assert not torch.equal(exact(ids).logits, tanh(ids).logits)
    untied = build_model(get_preset("bart", **SMALL, separate_stack_embeddings=True))
    assert untied.encoder.embeddings.tokens is not untied.decoder.embeddings.tokens
    shared = build_model(get_preset("bart", **SMALL))
    assert shared.encoder.embeddings.tokens is shared.decoder.embeddings.tokens


def test_replace_keeps_sections_and_extra_wins_when_given_again():
    cfg = get_preset("tiny", task=TaskHead(num_labels=4))
    assert cfg.replace(d_model=32).task.num_labels == 4
    assert cfg.replace(extra={"num_labels": 5}).task.num_labels == 5
    assert get_preset("tiny", task={"num_labels": 6}).task == TaskHead(num_labels=6)


@pytest.mark.parametrize("changes", [dict(extra={"num_labels": "3"}), dict(task=TaskHead), dict(output_router_logits=1),
                                     dict(extra={"quantization": ["int8"]}), dict(task={"heads": "mlm"})])
def test_a_setting_of_the_wrong_type_is_refused(changes):
    with pytest.raises((ConfigError, TypeError)):
        get_preset("tiny", **changes)
