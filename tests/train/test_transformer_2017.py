"""`transformer-2017-mt`: the 2017 Transformer as an encoder-decoder (post-LN, ReLU, sinusoidal positions, one token
table for both stacks tied to the output), trained on the numbers translation task."""
from __future__ import annotations

import json

import torch

import lmkit
from lmkit.config import get_preset
from lmkit.data.translation import make_pairs, task_tokenizer
from lmkit.models import build_model


def test_preset_is_the_papers_encoder_decoder_with_one_shared_tied_table():
    cfg = get_preset("transformer-2017-mt")
    assert (cfg.architecture, cfg.position, cfg.norm_placement, cfg.activation) == ("encoder-decoder", "sinusoidal",
                                                                                   "post", "relu")
    assert (cfg.d_model, cfg.n_layers, cfg.n_heads, cfg.d_ff) == (512, 6, 8, 2048)  # the paper's base model
    model = build_model(get_preset("transformer-2017-mt", vocab_size=50, d_model=16, n_layers=1, n_heads=2, d_ff=32))
    tables = [p for n, p in model.named_parameters() if p.shape == (50, 16)]
    assert len(tables) == 1  # source, target and output share one matrix
    assert not [n for n, _ in model.named_parameters() if "position" in n]  # sinusoidal: nothing learned
    ids = torch.randint(3, 50, (2, 7))
    out = model(ids, decoder_input_ids=ids[:, :5])
    assert out.logits.shape == (2, 5, 50)


def test_trains_on_the_numbers_task_and_reloads(tmp_path):
    from lmkit.train.translation import fit_pairs

    train, test = make_pairs(400, 8, seed=4)
    result = fit_pairs(train, test, task_tokenizer(), tmp_path, preset="transformer-2017-mt", steps=12, batch_size=16,
                       eval_every=12, lr=2e-3, warmup_steps=2, log_every=4, task="numbers", d_model=32, n_layers=1,
                       n_decoder_layers=1, n_heads=2, d_ff=64, embedding_scale=32 ** 0.5, dropout=0.0)
    rows = [json.loads(line) for line in (tmp_path / "metrics.jsonl").read_text().splitlines()]
    assert rows[-1]["loss"] < rows[0]["loss"] and 0 <= result["bleu"] <= 100
    model = lmkit.load_model(tmp_path)
    assert model.config.architecture == "encoder-decoder" and model.config.family == "transformer-2017"
