"""BART's five noisings (train/noise.py): each one's defining property, their composition under `--noise`, and a
denoise run with a chosen combination that `lmkit eval` scores under the same noising."""
from __future__ import annotations

import itertools
import json
from collections import Counter

import pytest
import torch

from lmkit.errors import LmkitError
from lmkit.objectives import sentence_permutation, text_infilling, token_deletion
from lmkit.train.noise import DEFAULT_NOISE, document_rotation, noiser, parse_noise, token_masking

MASK, STOP = 0, 1
ROW = list(range(2, 202))  # distinct tokens, so a corrupted row shows what happened to each


def gen(seed: int) -> torch.Generator:
    return torch.Generator().manual_seed(seed)


def test_token_masking_replaces_about_30_percent_one_for_one():
    fractions = []
    for seed in range(20):
        out = token_masking(ROW, MASK, generator=gen(seed))
        assert len(out) == len(ROW) and all(o in (MASK, t) for o, t in zip(out, ROW))
        fractions.append(out.count(MASK) / len(ROW))
    assert 0.27 < sum(fractions) / len(fractions) < 0.33


def test_token_deletion_keeps_order_and_drops_ten_percent():
    out = token_deletion(ROW, generator=gen(0))
    assert len(out) == len(ROW) - 20 and out == sorted(out) and set(out) <= set(ROW) and MASK not in out


def test_text_infilling_spans_one_mask_each_cover_30_percent_with_poisson3_lengths():
    lengths = Counter()
    for seed in range(30):
        out = text_infilling(ROW, MASK, generator=gen(seed))
        kept = [t for t in out if t != MASK]
        assert kept == sorted(kept) and len(ROW) - len(kept) == 60  # ceil(0.3 * 200) tokens hidden
        assert all(not (a == MASK and b == MASK) for a, b in zip(out, out[1:]))  # one mask per run
        gaps = [b - a - 1 for a, b in zip([1] + kept, kept + [202]) if b - a > 1]
        lengths.update(gaps)
    mean_gap = sum(k * v for k, v in lengths.items()) / sum(lengths.values())
    assert 2.5 < mean_gap < 5.5  # merged Poisson(3) spans: a mean a little above 3


def test_sentence_permutation_shuffles_whole_sentences():
    sentences = [(2, 3, STOP), (4, 5, 6, STOP), (7, STOP), (8, 9)]
    row = [t for s in sentences for t in s]
    seen = set()
    for seed in range(30):
        out = tuple(sentence_permutation(row, {STOP}, gen(seed)))
        orders = [p for p in itertools.permutations(sentences) if sum(p, ()) == out]
        assert orders  # the output is the sentences, whole, in some order
        seen.add(out)
    assert len(seen) > 5


def test_document_rotation_is_a_rotation_starting_anywhere():
    starts = set()
    for seed in range(60):
        out = document_rotation(ROW[:10], gen(seed))
        k = out.index(ROW[0])
        assert out[k:] + out[:k] == ROW[:10]
        starts.add(out[0])
    assert len(starts) >= 8


def test_noise_names_compose_in_fairseqs_order_and_unknown_names_are_refused():
    assert parse_noise(None) == parse_noise(DEFAULT_NOISE) == ("permutation", "infilling")
    assert parse_noise("rotation,masking,deletion") == ("masking", "deletion", "rotation")
    with pytest.raises(LmkitError, match="choose one or more of permutation, masking"):
        parse_noise("infilling,shuffle")
    row = [2, 3, STOP, 4, 5, 6, STOP, 7, STOP, 8, 9] * 5
    # the default is permutation then infilling, each drawing from the one generator in turn
    g1, g2 = gen(7), gen(7)
    expected = text_infilling(sentence_permutation(row, {STOP}, g1), MASK, generator=g1)
    assert noiser(None, MASK, {STOP})(row, g2) == expected
    both = noiser("masking,rotation", MASK, {STOP})(ROW, gen(3))
    g = gen(3)
    assert both == document_rotation(token_masking(ROW, MASK, generator=g), g)


def test_denoise_run_with_chosen_noise_is_scored_by_eval_under_that_noise(corpus_file, tmp_path, capsys):
    from lmkit.cli import main

    out = tmp_path / "run"
    assert main(["train", "--objective", "denoise", "--noise", "masking,deletion,rotation", "--corpus", corpus_file,
                 "--out", str(out), "--max-steps", "4", "--batch-size", "4", "--seq-len", "32",
                 "--precision", "fp32"]) == 0
    state = json.loads(next((out / "checkpoint").glob("step-*/state.json")).read_text())
    assert state["train_config"]["noise"] == "masking,deletion,rotation"
    metrics = [json.loads(line) for line in (out / "metrics.jsonl").read_text().splitlines()]
    capsys.readouterr()
    assert main(["eval", "--model", str(out)]) == 0
    line = next(l for l in capsys.readouterr().out.splitlines() if l.startswith("loss"))
    assert float(line.split()[1]) == pytest.approx(metrics[-1]["val_loss"], abs=1e-3)
    assert main(["train", "--objective", "mlm", "--noise", "masking", "--out", str(tmp_path / "x")]) == 2
    assert "--noise chooses BART's noisings of --objective denoise" in capsys.readouterr().err
