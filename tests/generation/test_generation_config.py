"""`generate` takes unset arguments (token ids, sampling and beam settings) from a folder's generation_config.json,
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


@pytest.mark.parametrize("settings", [
    dict(do_sample=True, top_k=5, temperature=0.7, max_new_tokens=6, repetition_penalty=1.3),
    dict(do_sample=True, top_p=0.8, top_k=0, num_return_sequences=2, max_new_tokens=5),
    dict(num_beams=3, length_penalty=0.5, no_repeat_ngram_size=2, num_return_sequences=2, max_new_tokens=7),
], ids=["top-k", "top-p-two-each", "beams"])
def test_sampling_and_beam_settings_of_the_folder_apply_when_unset(settings, tmp_path):
    torch.manual_seed(0)
    cfg = transformers.GPT2Config(vocab_size=61, n_embd=24, n_layer=2, n_head=2, n_positions=64)
    hf = transformers.GPT2LMHeadModel(cfg).eval()
    hf.generation_config = transformers.GenerationConfig(bos_token_id=1, eos_token_id=2, pad_token_id=0, **settings)
    hf.save_pretrained(tmp_path)
    model = lmkit.load_model(tmp_path)
    ids = torch.randint(3, 61, (2, 5), generator=torch.Generator().manual_seed(1))
    torch.manual_seed(7)
    theirs = hf.generate(ids, attention_mask=torch.ones_like(ids))
    torch.manual_seed(7)
    ours = model.generate(ids)
    assert ours.tolist() == theirs.tolist()
    assert ours.shape[0] == 2 * settings.get("num_return_sequences", 1)
    greedy = model.generate(ids, do_sample=False, num_beams=1, num_return_sequences=1)  # arguments win
    assert greedy.tolist() == hf.generate(ids, attention_mask=torch.ones_like(ids), do_sample=False, num_beams=1,
                                          num_return_sequences=1).tolist()


def test_max_length_of_the_folder_counts_the_prompt(bart_folder, tmp_path):
    """generation_config.json's max_length bounds prompt + continuation (the decoder start for BART), as in
    transformers; it survives saving, and a prompt that already fills it is one clear error."""
    from lmkit.errors import GenerationError

    torch.manual_seed(0)
    hf = transformers.GPT2LMHeadModel(transformers.GPT2Config(vocab_size=61, n_embd=24, n_layer=2, n_head=2,
                                                              n_positions=64)).eval()
    hf.generation_config = transformers.GenerationConfig(bos_token_id=1, eos_token_id=2, pad_token_id=0, max_length=12)
    hf.save_pretrained(tmp_path)
    model = lmkit.load_model(tmp_path)
    ids = torch.randint(3, 61, (2, 5), generator=torch.Generator().manual_seed(1))
    ours = model.generate(ids)
    assert ours.shape[1] <= 12 and ours.tolist() == hf.generate(ids, attention_mask=torch.ones_like(ids)).tolist()
    model.save_pretrained(tmp_path / "again")
    assert json.loads((tmp_path / "again" / "generation_config.json").read_text())["max_length"] == 12
    with pytest.raises(GenerationError, match="max_length"):
        model.generate(torch.randint(3, 61, (1, 12)))

    folder, bart = bart_folder  # no max_length: 20 new tokens after the decoder start
    src = torch.randint(3, 61, (2, 6), generator=torch.Generator().manual_seed(2))
    got = lmkit.load_model(folder).generate(src)
    assert got.tolist() == bart.generate(src, attention_mask=torch.ones_like(src)).tolist()


def test_unknown_generate_arguments_are_one_clear_error(bart_folder):
    from lmkit.errors import GenerationError

    torch.manual_seed(0)
    model = lmkit.CausalLM(lmkit.get_preset("tiny")).eval()
    with pytest.raises(GenerationError, match="does not know: max_new_token"):
        model.generate(torch.tensor([[1, 2, 3]]), max_new_token=4)


def test_without_generation_config_json_config_json_keys_apply(tmp_path):
    """A folder without generation_config.json (transformers 4, hand-written): transformers takes the generation keys
    of config.json (num_beams, max_length, forced tokens, ...), and so does lmkit."""
    torch.manual_seed(0)
    cfg = transformers.BartConfig(vocab_size=61, d_model=24, encoder_layers=2, decoder_layers=2, encoder_attention_heads=4,
                                  decoder_attention_heads=4, encoder_ffn_dim=40, decoder_ffn_dim=40,
                                  max_position_embeddings=48)
    transformers.BartForConditionalGeneration(cfg).save_pretrained(tmp_path)
    (tmp_path / "generation_config.json").unlink()
    raw = json.loads((tmp_path / "config.json").read_text())
    raw.update(num_beams=3, no_repeat_ngram_size=2, max_length=9, min_length=4, forced_bos_token_id=0,
               length_penalty=2.0, early_stopping=True)
    (tmp_path / "config.json").write_text(json.dumps(raw))
    hf = transformers.BartForConditionalGeneration.from_pretrained(tmp_path).eval()
    src = torch.randint(3, 61, (3, 11), generator=torch.Generator().manual_seed(3))
    theirs = hf.generate(src)
    assert theirs[:, 1].tolist() == [0, 0, 0]  # the forced BOS: the keys did apply
    assert lmkit.load_model(tmp_path).generate(src).tolist() == theirs.tolist()


def test_decoder_start_of_the_generation_config_wins(bart_folder, tmp_path):
    """generate starts the decoder from generation_config.json's decoder_start_token_id, as transformers does."""
    folder, _ = bart_folder
    for name in ("config.json", "model.safetensors"):
        (tmp_path / name).write_bytes((folder / name).read_bytes())
    saved = json.loads((folder / "generation_config.json").read_text())
    (tmp_path / "generation_config.json").write_text(json.dumps({**saved, "decoder_start_token_id": 7}))
    hf = transformers.BartForConditionalGeneration.from_pretrained(tmp_path).eval()
    src = torch.randint(3, 61, (2, 6), generator=torch.Generator().manual_seed(2))
    theirs = hf.generate(src, max_new_tokens=5)
    assert (theirs[:, 0] == 7).all()
    assert lmkit.load_model(tmp_path).generate(src, max_new_tokens=5).tolist() == theirs.tolist()


LENGTHS = [dict(max_new_tokens=0), dict(max_new_tokens=-1), dict(max_new_tokens=0, min_new_tokens=1),
           dict(max_new_tokens=0, max_length=10), dict(max_new_tokens=0, num_beams=2), dict(max_length=3),
           dict(max_length=2), dict(max_length=4), dict(max_new_tokens=1, min_new_tokens=5),
           dict(max_new_tokens=2, min_new_tokens=-1)]


@pytest.mark.filterwarnings("ignore::UserWarning")
@pytest.mark.parametrize("kwargs", LENGTHS, ids=lambda k: ",".join(f"{a}={b}" for a, b in k.items()))
def test_length_limits_match_transformers(bart_folder, tmp_path, kwargs):
    """max_new_tokens <= 0, and a max_length the prompt (3 tokens; BART's decoder start: 1) already fills, are the
    ValueError transformers raises; other limits give transformers' tokens, for both families."""
    torch.manual_seed(0)
    gpt = transformers.GPT2LMHeadModel(transformers.GPT2Config(vocab_size=61, n_embd=16, n_layer=1, n_head=2,
                                                               n_positions=32)).eval()
    gpt.save_pretrained(tmp_path)
    folder, bart = bart_folder
    ids = torch.tensor([[3, 4, 5]])
    bart_kwargs = {k: v - 2 if k == "max_length" else v for k, v in kwargs.items()}
    for hf, ours, args in ((gpt, lmkit.load_model(tmp_path), kwargs), (bart, lmkit.load_model(folder), bart_kwargs)):
        try:
            want = hf.generate(ids, attention_mask=torch.ones_like(ids), do_sample=False, **args)
        except ValueError:
            with pytest.raises(ValueError):
                ours.generate(ids, **args)
            continue
        assert ours.generate(ids, **args).tolist() == want.tolist()
