"""Beam-search checks against transformers' generate: the settings, peaked output layers, padded sources."""
from __future__ import annotations

import torch

import lmkit


V = 53


# tiny random models repeat themselves; a repetition penalty or n-gram blocking keeps the beams apart
SETTINGS = [
    dict(num_beams=3, length_penalty=1.0, early_stopping=False, repetition_penalty=1.5),
    dict(num_beams=4, length_penalty=2.0, early_stopping=True, repetition_penalty=1.5, num_return_sequences=2),
    dict(num_beams=3, length_penalty=0.5, early_stopping="never", repetition_penalty=1.5),
    dict(num_beams=2, length_penalty=-1.0, early_stopping=False, no_repeat_ngram_size=1),
    dict(num_beams=5, length_penalty=1.0, early_stopping=True, min_new_tokens=4, no_repeat_ngram_size=2,
         repetition_penalty=1.2, num_return_sequences=5),
]


IDS = ["k3", "k4-lp2-early-return2", "k3-never", "k2-ngram2", "k5-min4-ngram3-return5"]


def peaky(model, scale: float):
    """Scale the random output layer so that distributions are peaked and hypotheses end at EOS."""
    with torch.no_grad():
        model.get_output_embeddings().weight.mul_(scale)
    return model


def pick_eos(model, kwargs, n_new, setting):
    """Two tokens on the beams' own paths, so that hypotheses finish at EOS at different lengths."""
    setting = {k: v for k, v in setting.items() if k != "num_return_sequences"}
    out = model.generate(**kwargs, max_new_tokens=n_new, do_sample=False, eos_token_id=None, pad_token_id=1,
                         **setting)[:, -n_new:]
    eos = []
    for row, col in ((0, 3), (1, 5), (2, 2), (0, 6), (1, 1), (2, 7)):
        token = int(out[row, col])
        if token > 2 and token not in eos and len(eos) < 2:
            eos.append(token)
    return eos


def check_beams(hf_model, folder, kwargs, setting, n_new=10):
    """Beam search of lmkit's model, loaded from the folder hf_model saves, gives transformers' ids."""
    hf_model.generation_config.forced_eos_token_id = None
    hf_model.generation_config.forced_bos_token_id = None
    hf_model.save_pretrained(folder)
    ours = lmkit.load_model(folder)
    eos = pick_eos(hf_model, kwargs, n_new, setting)
    common = dict(max_new_tokens=n_new, eos_token_id=eos, pad_token_id=1, **setting)
    ref = hf_model.generate(**kwargs, do_sample=False, **common)
    got = ours.generate(kwargs["input_ids"], attention_mask=kwargs.get("attention_mask"), **common)
    assert got.tolist() == ref.tolist()
    if setting is SETTINGS[0]:  # the test means something: some hypothesis ended at EOS
        assert torch.isin(got[:, -n_new:], torch.tensor(eos)).any()
    return got, eos


def source_inputs(pad):
    torch.manual_seed(4)
    ids = torch.randint(3, V, (3, 9))
    mask = torch.ones_like(ids)
    mask[1, 6:] = 0
    return dict(input_ids=ids.masked_fill(mask == 0, pad), attention_mask=mask)
