"""The hub's family descriptions and the interfaces that keep the layers apart.

Every family module fills a `Family` whose config mapping writes the model_type and a transformers class it
declares; compression's load/save hooks are found through the hub's registry, imported on demand; the models
import neither the hub nor compression, and still save Hugging Face folders.
"""
import subprocess
import sys

import pytest

from lmkit.config import get_preset
from lmkit.errors import LmkitError
from lmkit.hub import _families
from lmkit.hub.family import Family


# presets, with the changes some formats need (Qwen2: q/k/v biases; mBART: pre-norm; mT5: an untied, unscaled head;
# BigBird: its attention pattern)
CANDIDATES = [("tiny", {}), ("default", {}), ("moe", {}),
              ("default", dict(attention_bias=True, attention_out_bias=False)),
              ("bert", {}), ("roberta", {}), ("distilbert", {}),
              ("t5-tiny", {}), ("t5-tiny", dict(output_scale=1.0, tie_embeddings=False)),
              ("bart", {}), ("bart", dict(norm_placement="pre", final_norm=True, decoder_start_from_labels=True)),
              ("xlnet-tiny", {}), ("longformer-tiny", {}), ("bert", dict(sparse={"sparse_attention": "bigbird"}))]


@pytest.mark.parametrize("model_type", sorted(_families()))
def test_each_family_writes_its_model_type_and_a_class_it_declares(model_type):
    family = _families()[model_type]
    assert isinstance(family, Family) and model_type in family.model_types
    for preset, changes in CANDIDATES:
        try:
            raw = family.config_to_hf(get_preset(preset, family=model_type, **changes))
        except LmkitError:  # the format cannot hold this preset
            continue
        assert raw["model_type"] == model_type
        assert raw["architectures"][0] in family.hf_classes
        assert family.config_from_hf(raw).family == model_type
        return
    pytest.fail(f"no preset fits the {model_type} format")


def _fresh(code: str) -> str:
    return subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True).stdout.strip()


def test_models_save_folders_without_importing_the_hub_first(tmp_path):
    out = _fresh(f"""
import sys
from lmkit.config import get_preset
from lmkit.models import CausalLM
before = 'lmkit.hub' in sys.modules
CausalLM(get_preset('tiny')).save_pretrained({str(tmp_path)!r})
print(before, 'lmkit.hub' in sys.modules)""")
    assert out == "False True"
    assert (tmp_path / "config.json").is_file() and (tmp_path / "model.safetensors").is_file()


def test_compression_hooks_are_imported_when_a_config_needs_them():
    out = _fresh("""
import sys
from lmkit.config import get_preset
from lmkit.hub.hooks import folder_hooks
plain = folder_hooks(get_preset('tiny'))
before = 'lmkit.compress.prune' in sys.modules
hooks = folder_hooks(get_preset('tiny', extra={'attention_heads': {'decoder.layers.0.self_attn.sublayer': [2, 2]}}))
print(plain, before, [h.key for h in hooks], hooks[0].build is not None)""")
    assert out == "[] False ['attention_heads'] True"
