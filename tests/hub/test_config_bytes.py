"""config.json as lmkit writes it, byte for byte, for every family, head class and preset, in the family's format
and in lmkit's own: the snapshot in config_bytes.json guards the spelling that transformers and earlier lmkit
folders rely on. Regenerate it only for a deliberate format change:
`python tests/hub/test_config_bytes.py --write`.
"""
from __future__ import annotations

import importlib
import json
import sys
from pathlib import Path

import pytest
import torch

from lmkit import ModelConfig
from lmkit.config import PRESETS, get_preset
from lmkit.errors import ConfigError
from lmkit.hub import FAMILY_MODULES, load_model, pruned_layout, save_pretrained
from lmkit.models import build_model

SNAPSHOT = Path(__file__).with_name("config_bytes.json")

# transformers' config class keywords for a tiny model of each model_type
SMALL = {
    "gpt2": dict(n_embd=16, n_layer=2, n_head=2, vocab_size=50, n_positions=32, bos_token_id=0, eos_token_id=0),
    "llama": dict(hidden_size=16, intermediate_size=24, num_hidden_layers=2, num_attention_heads=4,
                  num_key_value_heads=2, vocab_size=50, max_position_embeddings=32),
    "mistral": dict(hidden_size=16, intermediate_size=24, num_hidden_layers=2, num_attention_heads=4,
                    num_key_value_heads=2, vocab_size=50, max_position_embeddings=32, sliding_window=8),
    "qwen2": dict(hidden_size=16, intermediate_size=24, num_hidden_layers=2, num_attention_heads=4,
                  num_key_value_heads=2, vocab_size=50, max_position_embeddings=32, use_sliding_window=True,
                  sliding_window=8, max_window_layers=1),
    "mixtral": dict(hidden_size=16, intermediate_size=24, num_hidden_layers=2, num_attention_heads=4,
                    num_key_value_heads=2, vocab_size=50, max_position_embeddings=32, num_local_experts=3,
                    num_experts_per_tok=2, router_jitter_noise=0.1, output_router_logits=True),
    "bert": dict(hidden_size=16, num_hidden_layers=2, num_attention_heads=2, intermediate_size=24, vocab_size=50,
                 max_position_embeddings=40),
    "roberta": dict(hidden_size=16, num_hidden_layers=2, num_attention_heads=2, intermediate_size=24, vocab_size=50,
                    max_position_embeddings=40, pad_token_id=1),
    "distilbert": dict(dim=16, n_layers=2, n_heads=2, hidden_dim=24, vocab_size=50, max_position_embeddings=32),
    "t5": dict(d_model=16, d_kv=8, d_ff=24, num_layers=2, num_heads=2, vocab_size=50),
    "mt5": dict(d_model=16, d_kv=8, d_ff=24, num_layers=2, num_heads=2, vocab_size=50),
    "bart": dict(d_model=16, encoder_layers=1, decoder_layers=1, encoder_attention_heads=2, decoder_attention_heads=2,
                 encoder_ffn_dim=24, decoder_ffn_dim=24, vocab_size=50, max_position_embeddings=32),
    "mbart": dict(d_model=16, encoder_layers=1, decoder_layers=1, encoder_attention_heads=2, decoder_attention_heads=2,
                  encoder_ffn_dim=24, decoder_ffn_dim=24, vocab_size=50, max_position_embeddings=32),
    "xlnet": dict(d_model=16, n_layer=2, n_head=2, d_inner=24, vocab_size=50),
    "longformer": dict(hidden_size=16, num_hidden_layers=2, num_attention_heads=2, intermediate_size=24, vocab_size=50,
                       max_position_embeddings=40, attention_window=[8, 4]),
    "big_bird": dict(hidden_size=16, num_hidden_layers=2, num_attention_heads=2, intermediate_size=24, vocab_size=50,
                     max_position_embeddings=40, block_size=4, num_random_blocks=1),
}
# settings a task head reads, as config.json spells them
LABELS = dict(num_labels=3, problem_type="multi_label_classification", classifier_dropout=0.3,
              id2label={0: "a", 1: "b", 2: "c"}, label2id={"a": 0, "b": 1, "c": 2})
SMALL_PRESET = dict(vocab_size=64, d_model=32, n_layers=2, n_heads=2, n_kv_heads=None, head_dim=None, d_ff=48,
                    max_seq_len=32)


def _hf_raw(model_type: str, hf_class: str, **changes) -> dict:
    from transformers import CONFIG_MAPPING

    raw = CONFIG_MAPPING[model_type](**{**SMALL[model_type], **changes}).to_dict()
    raw["architectures"] = [hf_class]
    return raw


def _from_raw(raw: dict):
    from lmkit.hub import family_of

    family = family_of(raw["model_type"])
    config = family.config_from_hf(raw)
    if raw.get("pruned_heads"):
        config = pruned_layout(config, raw["pruned_heads"])
    return family.build(config, raw, ()) if family.build is not None and config.family else build_model(config)


def models():
    """(case name, model) for every head class of every family, every preset, and the compressed models."""
    torch.manual_seed(0)
    for module in FAMILY_MODULES:
        family = importlib.import_module(f"lmkit.hub.{module}").FAMILY
        for model_type in family.model_types:
            for hf_class in family.hf_classes:
                if model_type == "mt5" and not hf_class.startswith("MT5") or model_type == "t5" and hf_class.startswith("MT5"):
                    continue
                yield f"{model_type}/{hf_class}", _from_raw(_hf_raw(model_type, hf_class))
                if any(k in hf_class for k in ("Sequence", "Token", "Choice", "Question")):
                    yield f"{model_type}/{hf_class}/labels", _from_raw(_hf_raw(model_type, hf_class, **LABELS))
    yield "bart/untied", _from_raw(_hf_raw("bart", "BartForConditionalGeneration", tie_word_embeddings=False))
    yield "bert/v4-pruned", _from_raw({**_hf_raw("bert", "BertForSequenceClassification"), "pruned_heads": {"0": [1]}})
    for name in PRESETS:
        sizes = dict(SMALL_PRESET, n_experts=3 if PRESETS[name].get("n_experts") else 0)
        if PRESETS[name].get("position") == "relative":
            sizes.update(relative_max_distance=16)
        yield f"preset/{name}", build_model(get_preset(name, **sizes))
    yield "preset/roberta/gelu-head", build_model(get_preset("roberta", **SMALL_PRESET, extra={"mlm_activation": "gelu"}))
    yield "preset/tiny/unknown-extra", build_model(get_preset("tiny", extra={"note": {"kept": [1, "as is"]}}))
    yield "compress/pruned-bert", _pruned(_from_raw(_hf_raw("bert", "BertForSequenceClassification", **LABELS)))
    yield "compress/pruned-gpt2", _pruned(_from_raw(_hf_raw("gpt2", "GPT2LMHeadModel")))
    yield "compress/int8-llama", _quantized(_from_raw(_hf_raw("llama", "LlamaForCausalLM")))


def _pruned(model):
    from lmkit.compress.prune import attention_modules, prune_heads

    first = next(iter(attention_modules(model)))
    prune_heads(model, {first: [0]})
    return model


def _quantized(model):
    from lmkit.compress.quantize import quantize_dynamic_int8

    return quantize_dynamic_int8(model)


def written(model, folder: Path) -> dict[str, str]:
    """{format: config.json text}: the family's format (when the model has one; else why not) and lmkit's own."""
    out = {}
    if model.config.family:
        try:
            save_pretrained(model, folder / "family")
            out["family"] = (folder / "family" / "config.json").read_text(encoding="utf-8")
        except ConfigError as exc:
            out["family"] = f"refused: {exc}"
    model.config = model.config.replace(family=None)
    save_pretrained(model, folder / "lmkit")
    out["lmkit"] = (folder / "lmkit" / "config.json").read_text(encoding="utf-8")
    return out


def current(folder: Path) -> dict[str, dict[str, str]]:
    out = {}
    for name, model in models():
        out[name] = written(model, folder / name.replace("/", "_"))
        if not out[name].get("family", "refused").startswith("refused"):  # what lmkit reads back from its own folder, it writes again the same
            again = load_model(folder / name.replace("/", "_") / "family")
            assert written(again, folder / (name.replace("/", "_") + "_again"))["family"] == out[name]["family"], name
    return out


@pytest.fixture(scope="module")
def written_now(tmp_path_factory):
    return current(tmp_path_factory.mktemp("bytes"))


def test_every_case_is_in_the_snapshot(written_now):
    assert sorted(written_now) == sorted(json.loads(SNAPSHOT.read_text(encoding="utf-8")))


def test_config_json_bytes_are_unchanged(written_now):
    snapshot = json.loads(SNAPSHOT.read_text(encoding="utf-8"))
    for name, texts in written_now.items():
        assert texts == snapshot[name], name


def test_an_unknown_extra_key_passes_through(tmp_path):
    note = {"kept": [1, "as is"], "nested": {"x": None}}
    model = build_model(get_preset("tiny", family=None, extra={"note": note}))
    save_pretrained(model, tmp_path)
    raw = json.loads((tmp_path / "config.json").read_text(encoding="utf-8"))
    assert raw["lmkit"]["extra"] == {"note": note}
    assert load_model(tmp_path).config.extra == {"note": note}
    assert ModelConfig.from_dict(model.config.to_dict()) == model.config


if __name__ == "__main__" and "--write" in sys.argv:
    import tempfile

    with tempfile.TemporaryDirectory() as tmp:
        SNAPSHOT.write_text(json.dumps(current(Path(tmp)), indent=1, sort_keys=True) + "\n", encoding="utf-8")
    print(f"wrote {SNAPSHOT}")
