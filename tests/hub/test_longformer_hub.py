"""Longformer folders against transformers, both ways: LongformerModel, ...ForMaskedLM and ...ForSequenceClassification
on random small configs (per-layer windows, odd lengths that need padding to the window multiple, global tokens at
the first, middle and last positions, batches with right padding), in eval mode; hidden states and logits within
1e-5."""
from __future__ import annotations

import dataclasses

import pytest
import torch

import lmkit
from lmkit.config import get_preset
from lmkit.errors import ConfigError
from lmkit.models import build_model

from helpers.hub_pairs import randomized

transformers = pytest.importorskip("transformers")
transformers.logging.set_verbosity_error()

VOCAB = 101
HEADS = ("LongformerModel", "LongformerForMaskedLM", "LongformerForSequenceClassification")


def hf_config(**kw):
    # transformers pads to the largest window, and each layer's chunks need that length to be a multiple of its own
    # window, with a one-sided window of 2 or more: [4, 8, 4] over lengths padded to 8s qualifies (lmkit needs neither)
    base = dict(vocab_size=VOCAB, hidden_size=24, num_hidden_layers=3, num_attention_heads=3, intermediate_size=40,
                attention_window=[4, 8, 4], max_position_embeddings=80, type_vocab_size=1, num_labels=3)
    return transformers.LongformerConfig(**{**base, **kw})


def inputs(B: int, T: int, seed: int):
    g = torch.Generator().manual_seed(seed)
    ids = torch.randint(3, VOCAB, (B, T), generator=g)
    mask = torch.ones_like(ids)
    for row in range(1, B):  # row 0 full, the others right-padded to different lengths
        mask[row, T - 3 * row - 1:] = 0
    ids[mask == 0] = 1
    glob = torch.zeros_like(ids)
    glob[0, [0, T // 2, T - 1]] = 1
    if B > 1:
        glob[1, 2] = 1
    return ids, mask, glob


def outputs(out, head: str) -> dict[str, torch.Tensor]:
    if head == "LongformerModel":
        return {"last_hidden_state": out.last_hidden_state, "pooler_output": out.pooler_output}
    return {"logits": out.logits}


@pytest.mark.parametrize("head", HEADS)
def test_a_transformers_folder_loads_with_equal_outputs(head, tmp_path):
    torch.manual_seed(0)
    hf = randomized(getattr(transformers, head)(hf_config()))
    hf.save_pretrained(tmp_path)
    ours = lmkit.load_model(tmp_path).eval()
    assert ours.config.sparse.attention_window == [4, 8, 4]
    for T, seed in ((23, 0), (16, 1), (5, 2)):  # padded to 24, a multiple already, shorter than the largest window
        ids, mask, glob = inputs(3 if T > 5 else 1, T, seed)
        for kwargs in ({}, {"attention_mask": mask}, {"attention_mask": mask, "global_attention_mask": glob}):
            with torch.no_grad():  # lmkit's batched blocks
                want, batched = outputs(hf(ids, **kwargs), head), outputs(ours(ids, **kwargs), head)
            tiled = outputs(ours(ids, **kwargs), head)  # autograd recording: the block tiles
            for got in (batched, tiled):
                for name, w in want.items():
                    torch.testing.assert_close(got[name].detach(), w, atol=1e-5, rtol=0,
                                               msg=f"{name} T={T} {sorted(kwargs)}")


def test_an_lmkit_longformer_saves_a_folder_transformers_loads_with_equal_outputs(tmp_path):
    cfg = get_preset("longformer-tiny", vocab_size=VOCAB, d_model=32, n_heads=4, d_ff=48, max_seq_len=60,
                     sparse={"sparse_attention": "longformer", "attention_window": [12, 12]})
    torch.manual_seed(1)
    ours = randomized(build_model(cfg))
    ours.save_pretrained(tmp_path)
    hf = transformers.AutoModelForMaskedLM.from_pretrained(tmp_path).eval()
    assert type(hf).__name__ == "LongformerForMaskedLM" and hf.config.attention_window == [12, 12]
    ids, mask, glob = inputs(2, 31, 3)
    with torch.no_grad():
        want = hf(ids, attention_mask=mask, global_attention_mask=glob).logits
        got = ours(ids, attention_mask=mask, global_attention_mask=glob).logits
    torch.testing.assert_close(got, want, atol=1e-5, rtol=0)
    again = lmkit.load_model(tmp_path)
    assert again.config.sparse == cfg.sparse


def test_a_single_window_in_config_json_is_every_layers_window(tmp_path):
    hf = transformers.LongformerModel(hf_config(attention_window=6))
    hf.save_pretrained(tmp_path)
    assert lmkit.load_model(tmp_path).config.sparse.attention_window == [6, 6, 6]


def test_a_global_attention_mask_of_the_wrong_shape_is_refused_in_one_line():
    model = build_model(get_preset("longformer-tiny", vocab_size=VOCAB, max_seq_len=40)).eval()
    ids = torch.randint(3, VOCAB, (2, 9))
    with pytest.raises(ConfigError, match=r"global_attention_mask has shape \(2, 8\).*shaped like input_ids"):
        model(ids, global_attention_mask=torch.zeros(2, 8, dtype=torch.long))
    with pytest.raises(ConfigError, match="Longformer models only"):
        build_model(get_preset("bert-tiny")).eval()(ids, global_attention_mask=torch.zeros_like(ids))


def test_a_roberta_format_refuses_a_longformer_model(tmp_path):
    cfg = get_preset("longformer-tiny", vocab_size=VOCAB, max_seq_len=40)
    with pytest.raises(ConfigError, match="family='longformer'"):
        build_model(cfg.replace(family="roberta")).save_pretrained(tmp_path)


def test_windows_transformers_cannot_run_are_refused_on_save_and_odd_windows_on_build(tmp_path):
    base = get_preset("longformer-tiny", vocab_size=VOCAB, max_seq_len=40)
    for windows in ([4, 6], [2, 4]):
        cfg = base.replace(sparse=dataclasses.replace(base.sparse, attention_window=windows))
        with pytest.raises(ConfigError, match=r"cannot run attention_window .*divide the largest one"):
            build_model(cfg).save_pretrained(tmp_path)
    with pytest.raises(ConfigError, match="one even, positive window per layer"):
        get_preset("longformer-tiny", sparse={"sparse_attention": "longformer", "attention_window": [64, 7]})
    with pytest.raises(ConfigError, match="lists 3 windows for 2 layers"):
        get_preset("longformer-tiny", sparse={"sparse_attention": "longformer", "attention_window": [8, 8, 8]})
