"""GenerationConfig owns generate's settings: a config object and keyword arguments decode alike, keywords win
over the object, the folder's generation_config.json fills what is unset, and its keys are the hub's key list."""
import json

import pytest
import torch

import lmkit
from lmkit.errors import GenerationError
from lmkit.generation import GenerationConfig
from lmkit.hub import GENERATION_DEFAULT_KEYS

transformers = pytest.importorskip("transformers")


@pytest.fixture(scope="module")
def gpt2(tmp_path_factory):
    torch.manual_seed(0)
    cfg = transformers.GPT2Config(vocab_size=53, n_embd=16, n_layer=2, n_head=2, n_positions=48)
    folder = tmp_path_factory.mktemp("gpt2")
    transformers.GPT2LMHeadModel(cfg).save_pretrained(folder)
    return folder


def test_keys_match_transformers_generation_config_fields():
    ours = set(GenerationConfig.field_names())
    theirs = set(transformers.GenerationConfig().to_dict())
    assert ours <= theirs, ours - theirs  # every setting lmkit takes is one transformers knows by that name
    assert set(GENERATION_DEFAULT_KEYS) == set(GenerationConfig.file_keys())


def test_config_object_and_keywords_decode_alike(gpt2):
    model = lmkit.load_model(gpt2)
    ids = torch.randint(0, 53, (2, 7))
    settings = dict(do_sample=True, top_k=7, temperature=0.8, max_new_tokens=6, repetition_penalty=1.2)
    torch.manual_seed(3)
    by_keywords = model.generate(ids, **settings)
    torch.manual_seed(3)
    by_object = model.generate(ids, generation_config=GenerationConfig(**settings))
    assert torch.equal(by_keywords, by_object)
    # a keyword is written over the object's field
    shorter = model.generate(ids, generation_config=GenerationConfig(max_new_tokens=9), max_new_tokens=3)
    assert shorter.shape[1] == 7 + 3


def test_round_trip_through_generation_config_json(gpt2, tmp_path):
    config = GenerationConfig(do_sample=True, top_p=0.9, eos_token_id=[3, 4], max_new_tokens=5)
    config.save_pretrained(tmp_path)
    raw = json.loads((tmp_path / "generation_config.json").read_text())
    assert raw == {"do_sample": True, "top_p": 0.9, "eos_token_id": [3, 4], "max_new_tokens": 5}
    assert GenerationConfig.from_pretrained(tmp_path) == config
    theirs = transformers.GenerationConfig.from_pretrained(tmp_path)  # transformers reads the same file alike
    assert (theirs.do_sample, theirs.top_p, theirs.eos_token_id, theirs.max_new_tokens) == (True, 0.9, [3, 4], 5)


def test_resolved_fills_from_folder_then_transformers_defaults():
    resolved = GenerationConfig(top_k=3).resolved({"top_k": 9, "temperature": 0.5})
    assert (resolved.top_k, resolved.temperature, resolved.num_beams, resolved.do_sample) == (3, 0.5, 1, False)
    with pytest.raises(GenerationError, match="top_p"):
        GenerationConfig(top_p=0).resolved()
    with pytest.raises(GenerationError, match="greedy decoding returns one sequence"):
        GenerationConfig(num_return_sequences=2).resolved()
