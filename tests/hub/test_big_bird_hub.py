"""BigBird folders against transformers, both ways: BigBirdModel, ...ForMaskedLM and ...ForSequenceClassification on
random small configs, in `block_sparse` mode (odd lengths padded to the block multiple, batches with right padding)
and `original_full` mode, and the full-attention fallback for inputs too short for the pattern.

Random blocks: transformers' eval mode is deterministic (every random block is block 0, its "no randomness during
inference"), and lmkit's eval mode does the same, so eval outputs are compared as they are. In training mode
(dropout 0) the random blocks are fixed on both sides: transformers' draw is replaced by the blocks lmkit draws from
its seed, layer by layer, and the outputs must then agree too.
"""
from __future__ import annotations

import pytest
import torch

import lmkit
from lmkit.errors import ConfigError
from lmkit.models import build_model
from lmkit.nn.bigbird_attention import full_attention_needed, random_blocks

from helpers.hub_pairs import randomized

transformers = pytest.importorskip("transformers")
transformers.logging.set_verbosity_error()

VOCAB = 101
HEADS = ("BigBirdModel", "BigBirdForMaskedLM", "BigBirdForSequenceClassification")
BLOCK, RANDOM = 4, 2   # the pattern needs more than (5 + 2 * 2) * 4 = 36 tokens


def hf_config(**kw):
    base = dict(vocab_size=VOCAB, hidden_size=24, num_hidden_layers=2, num_attention_heads=3, intermediate_size=40,
                block_size=BLOCK, num_random_blocks=RANDOM, max_position_embeddings=96, hidden_dropout_prob=0.0,
                attention_probs_dropout_prob=0.0, num_labels=3)
    return transformers.BigBirdConfig(**{**base, **kw})


def inputs(B: int, T: int, seed: int):
    g = torch.Generator().manual_seed(seed)
    ids = torch.randint(3, VOCAB, (B, T), generator=g)
    mask = torch.ones_like(ids)
    for row in range(1, B):
        mask[row, T - 5 * row - 2:] = 0
    ids[mask == 0] = 0
    return ids, mask


def compare(hf, ours, ids, mask, head, atol=1e-5):
    base = hf if head == "BigBirdModel" else hf.bert
    base.set_attention_type(hf.config.attention_type)  # transformers keeps a fallback to full attention once taken
    with torch.no_grad():
        want, got = hf(ids, attention_mask=mask), ours(ids, attention_mask=mask)
    names = ("last_hidden_state", "pooler_output") if head == "BigBirdModel" else ("logits",)
    for name in names:
        torch.testing.assert_close(getattr(got, name), getattr(want, name), atol=atol, rtol=0, msg=name)


@pytest.mark.parametrize("attention_type", ["block_sparse", "original_full"])
@pytest.mark.parametrize("head", HEADS)
def test_a_transformers_folder_loads_with_equal_eval_outputs(head, attention_type, tmp_path):
    torch.manual_seed(0)
    hf = randomized(getattr(transformers, head)(hf_config(attention_type=attention_type, hidden_act="gelu")))
    hf.save_pretrained(tmp_path)
    ours = lmkit.load_model(tmp_path).eval()
    assert ours.config.sparse.attention_type == attention_type
    for T, seed in ((61, 0), (40, 1), (37, 2), (20, 3)):  # padded, a multiple, just long enough, the fallback
        ids, mask = inputs(3, T, seed)
        compare(hf, ours, ids, mask, head)
    assert full_attention_needed(36, BLOCK, RANDOM) and not full_attention_needed(37, BLOCK, RANDOM)


def test_training_mode_with_the_random_blocks_fixed_on_both_sides_equals_transformers(tmp_path, monkeypatch):
    torch.manual_seed(1)
    hf = randomized(transformers.BigBirdForMaskedLM(hf_config(rescale_embeddings=True)))
    hf.save_pretrained(tmp_path)
    ours = lmkit.load_model(tmp_path)
    assert ours.config.embedding_scale == 24 ** 0.5
    n_blocks = 56 // BLOCK
    for layer_index, layer in enumerate(hf.bert.encoder.layer):
        drawn = random_blocks(n_blocks, RANDOM, 3, seed=layer_index)  # lmkit's layer i draws from random_seed + i
        monkeypatch.setattr(layer.attention.self, "_bigbird_block_rand_mask_with_head",
                            lambda *a, drawn=drawn, **k: [d.numpy() for d in drawn])
    hf.train(), ours.train()
    ids, mask = inputs(2, 53, 4)
    with torch.no_grad():  # lmkit's batched blocks
        want, got = hf(ids, attention_mask=mask).logits, ours(ids, attention_mask=mask).logits
    torch.testing.assert_close(got, want, atol=1e-5, rtol=0)
    tiled = ours(ids, attention_mask=mask).logits  # autograd recording: the block tiles
    torch.testing.assert_close(tiled.detach(), want, atol=1e-5, rtol=0)
    ours.eval()
    with torch.no_grad():  # eval mode has no random blocks, so the blocks drawn above did change the outputs
        assert (ours(ids, attention_mask=mask).logits - want).abs().max() > 1e-3


def test_random_blocks_are_reproducible_from_the_seed_and_avoid_window_and_global_blocks():
    a, b, c = random_blocks(12, 3, 4, seed=7), random_blocks(12, 3, 4, seed=7), random_blocks(12, 3, 4, seed=8)
    assert torch.equal(a, b) and not torch.equal(a, c)
    assert a.shape == (4, 10, 3)
    for i in range(1, 11):
        chosen = a[:, i - 1]
        assert all(len(set(row.tolist())) == 3 for row in chosen)
        assert not any(int(j) in (0, 11, i - 1, i, i + 1) for j in chosen.flatten())


@pytest.mark.parametrize("head", ["BigBirdForMaskedLM", "BigBirdForSequenceClassification"])
def test_an_lmkit_bigbird_saves_a_folder_transformers_loads_with_equal_outputs(head, tmp_path):
    torch.manual_seed(2)
    src = tmp_path / "src"
    randomized(getattr(transformers, head)(hf_config(hidden_act="gelu_new"))).save_pretrained(src)
    ours = randomized(lmkit.load_model(src))
    ours.save_pretrained(tmp_path / "out")
    hf = getattr(transformers, head).from_pretrained(tmp_path / "out").eval()
    for T, seed in ((45, 5), (30, 6)):
        ids, mask = inputs(2, T, seed)
        compare(hf, ours, ids, mask, head)


def test_a_bert_format_refuses_a_bigbird_model(tmp_path):
    cfg = lmkit.config.get_preset("bert-tiny", sparse={"sparse_attention": "bigbird"})
    with pytest.raises(ConfigError, match="family='big_bird'"):
        build_model(cfg).save_pretrained(tmp_path)


def test_a_global_attention_mask_is_refused_by_bigbird_in_one_line():
    model = build_model(lmkit.config.get_preset("bert-tiny", family="big_bird", sparse={"sparse_attention": "bigbird"}))
    ids = torch.randint(3, 100, (1, 9))
    with pytest.raises(ConfigError, match="Longformer models only"):
        model(ids, global_attention_mask=torch.zeros_like(ids))
