"""Generating from a masked LM: Mask-Predict's schedule and choice of what to re-mask, Gibbs resampling, and
`lmkit generate` on an encoder folder."""
from __future__ import annotations

import pytest
import torch

from lmkit.errors import LmkitError
from lmkit.generation.mask_predict import gibbs_resample, mask_predict, remask_counts
from lmkit.models.output import ModelOutput

V, MASK, CLS, SEP = 20, 1, 2, 3


class Scripted(torch.nn.Module):
    """Position p prefers token 4 + p % 16 with a confidence that grows with p; records each input it reads."""

    def __init__(self):
        super().__init__()
        self.w = torch.nn.Parameter(torch.zeros(()))
        self.seen: list[list[int]] = []

    def forward(self, ids, attention_mask=None):
        self.seen.append(ids[0].tolist())
        T = ids.shape[1]
        logits = torch.zeros(1, T, V)
        for p in range(T):
            logits[0, p, 4 + p % 16] = 0.2 * p
            logits[0, p, MASK] = logits[0, p, CLS] = 50.0  # special tokens are never chosen, however likely
        return ModelOutput(logits=logits + self.w)


@pytest.mark.parametrize("length,iterations", [(10, 10), (7, 3), (16, 4), (5, 1), (3, 8)])
def test_remask_counts_fall_linearly_from_all_to_none(length, iterations):
    counts = remask_counts(length, iterations)
    assert len(counts) == iterations and counts[0] == length
    assert all(a >= b for a, b in zip(counts, counts[1:]))
    assert counts == [length * (iterations - t) // iterations for t in range(iterations)]
    with pytest.raises(LmkitError):
        remask_counts(length, 0)


def test_each_iteration_remasks_the_least_confident_and_keeps_prompt_and_end():
    model = Scripted()
    prefix, length, T = [CLS, 7, 8], 8, 4
    out, history = mask_predict(model, prefix, length, MASK, [SEP], iterations=T, special_ids=[CLS, SEP])
    assert out == [4 + p % 16 for p in range(3, 3 + length)] and MASK not in out and CLS not in out
    counts = remask_counts(length, T)
    for seen, n in zip(model.seen, counts):
        assert seen[:3] == prefix and seen[-1] == SEP
        masked = [p - 3 for p, t in enumerate(seen) if t == MASK]
        # confidence grows with the position, so the n least confident are the first n generated positions
        assert masked == list(range(n))
    assert len(history) == len([c for c in counts if c]) and history[-1] == out


def test_sampling_at_a_temperature_is_repeatable_by_seed():
    model = Scripted()
    a = mask_predict(model, [CLS], 6, MASK, [], 3, [CLS], temperature=5.0, generator=torch.Generator().manual_seed(0))
    b = mask_predict(model, [CLS], 6, MASK, [], 3, [CLS], temperature=5.0, generator=torch.Generator().manual_seed(0))
    assert a == b and MASK not in a[0] and CLS not in a[0]


def test_gibbs_resamples_one_position_at_a_time_within_the_span():
    model = Scripted()
    start = [CLS, 5, 5, 5, 5, SEP]
    out = gibbs_resample(model, start, [1, 2, 3, 4], MASK, steps=8, special_ids=[CLS, SEP], temperature=0.01,
                         generator=torch.Generator().manual_seed(1))
    for seen in model.seen:  # each step reads the row with exactly one of the span's positions masked
        assert seen.count(MASK) == 1 and seen.index(MASK) in (1, 2, 3, 4) and seen[0] == CLS and seen[-1] == SEP
    assert out == [CLS] + [4 + p for p in range(1, 5)] + [SEP]  # near-greedy draws settle on each favourite


def test_lmkit_generate_fills_masks_after_the_prompt_of_a_masked_lm_run(corpus_file, tmp_path, capsys):
    from lmkit.cli import main
    from lmkit.train.config import TrainConfig
    from lmkit.train.trainer import Trainer

    out = tmp_path / "mlm"
    Trainer(TrainConfig(preset="bert-tiny", objective="mlm", corpus=[corpus_file], out=str(out), max_steps=2,
                        batch_size=4, seq_len=32, vocab_size=400, precision="fp32", progress=False)).fit()
    capsys.readouterr()
    args = ["generate", "--model", str(out), "--prompt", "Return the", "--max-new-tokens", "6", "--seed", "0"]
    assert main(args + ["--iterations", "3", "--gibbs-steps", "4", "--temperature", "0.7"]) == 0
    first = capsys.readouterr().out
    assert first.startswith("Return the") and len(first.strip()) > len("Return the")
    assert main(args + ["--iterations", "3", "--gibbs-steps", "4", "--temperature", "0.7"]) == 0
    assert capsys.readouterr().out == first  # seeded: the same text
    assert main(args + ["--num-beams", "2"]) == 2
    assert "Mask-Predict" in capsys.readouterr().err
