"""Scheduled sampling (Bengio et al. 2015): the three decays, the mixing of the model's own predictions into the
inputs, and training with it for a decoder-only (`lmkit train --scheduled-sampling`) and an encoder-decoder model."""
from __future__ import annotations

import json
import math

import pytest
import torch

from lmkit.config import get_preset
from lmkit.errors import LmkitError
from lmkit.models import build_model
from lmkit.objectives import IGNORE_INDEX, next_token_loss
from lmkit.train.scheduled import ScheduledSampling, mix_inputs, teacher_forcing_probability


def test_the_three_decays_start_at_teacher_forcing_and_fall():
    for spec in ("linear:50", "exponential:0.9", "inverse_sigmoid:10"):
        eps = [teacher_forcing_probability(spec, i) for i in range(0, 400, 5)]
        assert eps[0] > 0.9 and all(a >= b for a, b in zip(eps, eps[1:])) and eps[-1] < 0.01
    assert teacher_forcing_probability("linear:50", 25) == pytest.approx(0.5)
    assert teacher_forcing_probability("exponential:0.9", 3) == pytest.approx(0.9 ** 3)
    assert teacher_forcing_probability("inverse_sigmoid:10", 20) == pytest.approx(10 / (10 + math.exp(2)))
    for bad in ("inverse_sigmoid:0.5", "exponential:2", "linear:0", "cosine:3", "linear"):
        with pytest.raises(LmkitError, match="--scheduled-sampling"):
            teacher_forcing_probability(bad, 0)


def test_mixing_replaces_real_inputs_after_the_first_by_the_previous_positions_prediction():
    torch.manual_seed(0)
    inputs = torch.arange(10, 40).reshape(3, 10)
    predicted = -torch.arange(30).reshape(3, 10) - 1
    keep = torch.ones_like(inputs, dtype=torch.bool)
    keep[2, 6:] = False  # padding
    assert torch.equal(mix_inputs(inputs, predicted, keep, 1.0), inputs)
    all_model = mix_inputs(inputs, predicted, keep, 0.0)
    assert torch.equal(all_model[:, 0], inputs[:, 0])
    assert torch.equal(all_model[:2, 1:], predicted[:2, :-1]) and torch.equal(all_model[2, 6:], inputs[2, 6:])
    half = mix_inputs(inputs.repeat(200, 1), predicted.repeat(200, 1), keep.repeat(200, 1), 0.5)
    swapped = (half[:, 1:] < 0)[keep.repeat(200, 1)[:, 1:]].float().mean()
    assert 0.45 < float(swapped) < 0.55


def test_with_full_teacher_forcing_the_loss_is_the_next_token_loss():
    model = build_model(get_preset("tiny", vocab_size=50, d_model=16, n_layers=1, n_heads=2, d_ff=32, dropout=0.0))
    inputs = torch.randint(3, 50, (2, 9))
    labels = torch.randint(3, 50, (2, 9))
    labels[1, 6:] = IGNORE_INDEX
    batch = {"input_ids": inputs, "labels": labels, "teacher_forcing": torch.ones(2)}
    ours = ScheduledSampling("linear:10").loss(model, batch)[0]
    ref = next_token_loss(model(inputs).logits, labels)
    torch.testing.assert_close(ours.sum, ref.sum)
    assert int(ours.count) == int(ref.count)
    torch.manual_seed(1)
    mixed = ScheduledSampling("linear:10").loss(model, {**batch, "teacher_forcing": torch.zeros(2)})[0]
    assert int(mixed.count) == int(ref.count) and not torch.isclose(mixed.sum, ref.sum)


@pytest.mark.slow  # a minute on a busy 2-core machine (the CLI's own start and tokenizer)
def test_lmkit_train_with_scheduled_sampling(corpus_file, tmp_path, capsys):
    from lmkit.cli import main

    out = tmp_path / "run"
    assert main(["train", "--preset", "tiny", "--corpus", corpus_file, "--out", str(out), "--max-steps", "6",
                 "--batch-size", "4", "--seq-len", "32", "--scheduled-sampling", "inverse_sigmoid:2",
                 "--precision", "fp32"]) == 0
    state = json.loads(next((out / "checkpoint").glob("step-*/state.json")).read_text())
    assert state["train_config"]["scheduled_sampling"] == "inverse_sigmoid:2"
    assert main(["train", "--objective", "mlm", "--scheduled-sampling", "linear:5", "--out", str(tmp_path / "x")]) == 2
    assert "applies to --objective clm" in capsys.readouterr().err


def test_encoder_decoder_pairs_train_with_scheduled_sampling(tmp_path):
    from lmkit.data.translation import make_pairs, task_tokenizer
    from lmkit.train.translation import fit_pairs

    train, test = make_pairs(300, 4, seed=1)
    result = fit_pairs(train, test, task_tokenizer(), tmp_path, steps=8, batch_size=16, eval_every=8, lr=2e-3,
                       warmup_steps=1, log_every=2, d_model=32, n_layers=1, n_decoder_layers=1, n_heads=2, head_dim=16,
                       d_ff=64, output_scale=32 ** -0.5, scheduled_sampling="linear:8")
    rows = [json.loads(line) for line in (tmp_path / "metrics.jsonl").read_text().splitlines()]
    assert rows[-1]["loss"] < rows[0]["loss"] and 0 <= result["bleu"] <= 100
