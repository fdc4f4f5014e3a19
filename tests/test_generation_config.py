"""`generate` takes unset token ids (eos, pad, forced BOS/EOS) from a folder's generation_config.json,
as transformers does: a BART folder forces EOS at the last step with no argument given."""
import json

import pytest
import torch

import lmkit

transformers = pytest.importorskip("transformers")


@pytest.fixture(scope="module")
def bart_folder(tmp_path_factory):
    torch.manual_seed(0)
    cfg = transformers.BartConfig(vocab_size=61, d_model=24, encoder_layers=2, decoder_layers=2, encoder_attention_heads=4,
                                  decoder_attention_heads=4, encoder_ffn_dim=40, decoder_ffn_dim=40,
                                  max_position_embeddings=48)
    hf = transformers.BartForConditionalGeneration(cfg).eval()
    folder = tmp_path_factory.mktemp("bart")
    hf.save_pretrained(folder)
    return folder, hf


def test_folder_defaults_reach_generate(bart_folder):
    folder, hf = bart_folder
    saved = json.loads((folder / "generation_config.json").read_text())
    assert saved["forced_eos_token_id"] == 2
    model = lmkit.load_model(folder)
    assert model.generation_defaults["forced_eos_token_id"] == 2
    src = torch.randint(3, 61, (3, 11))
    mask = torch.ones_like(src)
    mask[1, 8:] = 0
    for kwargs in ({}, {"num_beams": 3}):
        ours = model.generate(src, attention_mask=mask, max_new_tokens=7, **kwargs)
        theirs = hf.generate(src, attention_mask=mask, max_new_tokens=7, do_sample=False, **kwargs)
        assert ours.tolist() == theirs.tolist()
        assert (ours[:, -1] == 2).all() or ours.shape[1] < 8  # forced EOS at the last step


def test_explicit_argument_wins_and_defaults_survive_saving(bart_folder, tmp_path):
    folder, _ = bart_folder
    model = lmkit.load_model(folder)
    src = torch.randint(3, 61, (2, 9))
    free = model.generate(src, max_new_tokens=6, forced_eos_token_id=[])
    forced = model.generate(src, max_new_tokens=6)
    assert (forced[:, -1] == 2).all()
    assert free[:, :-1].tolist() == forced[:, :-1].tolist()
    model.save_pretrained(tmp_path)
    assert lmkit.load_model(tmp_path).generation_defaults == model.generation_defaults
