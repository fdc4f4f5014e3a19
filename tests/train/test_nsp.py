"""`--objective mlm-nsp`: BERT's pre-training pairs, its combined loss against transformers' BertForPreTraining, and a
run that reports masked-token and NSP accuracy on held-out pairs (train, eval)."""
from __future__ import annotations

import json

import pytest
import torch

import lmkit
from lmkit.config import get_preset
from lmkit.models import build_model
from lmkit.objectives import IGNORE_INDEX
from lmkit.train.config import TrainConfig
from lmkit.train.nsp import MaskedLMNextSentence, first_piece, sentence_pairs
from lmkit.train.trainer import Trainer

BOS, PAD, CLS, SEP, MASK = 1, 0, 2, 3, 4
CORPUS_DOCS = 40
# with their pydocs ids: an id-less JSONL line is named PATH:LINE, so the train/validation split (by id hash)
# would follow the fixture's temporary path, which differs between a lone run and an xdist worker
CORPUS_IDS = True


def packed_rows(pieces: list[list[int]], width: int) -> torch.Tensor:
    """BOS-led rows as the packed stream gives them: the piece, then BOS and the next piece."""
    rows = []
    for i, p in enumerate(pieces):
        nxt = pieces[(i + 1) % len(pieces)]
        row = ([BOS] + p + [BOS] + nxt + [BOS] * width)[:width]
        rows.append(row)
    return torch.tensor(rows)


def test_pairs_are_cls_a_sep_b_sep_with_next_or_another_rows_segment():
    g = torch.Generator().manual_seed(0)
    # each piece holds values of its own range, so where a segment came from shows in its values
    pieces = [list(range(100 * (i + 1), 100 * (i + 1) + n)) for i, n in enumerate([30, 7, 2, 25, 19, 12] * 20)]
    rows = packed_rows(pieces, 24)
    batch = sentence_pairs(rows, CLS, SEP, PAD, 23, g)
    labels = batch["next_sentence_label"]
    assert 0.35 < labels.float().mean() < 0.65  # NotNext half the time
    for b in range(len(rows)):
        ids = batch["input_ids"][b][batch["attention_mask"][b].bool()].tolist()
        types = batch["token_type_ids"][b][batch["attention_mask"][b].bool()].tolist()
        assert ids[0] == CLS and ids[-1] == SEP and ids.count(SEP) == 2 and len(ids) <= 23
        cut = ids.index(SEP)
        a, seg_b = ids[1:cut], ids[cut + 1:-1]
        assert types == [0] * (cut + 1) + [1] * (len(seg_b) + 1)
        piece = first_piece(rows[b].tolist(), BOS, PAD)
        assert a == piece[:len(a)] and len(a) >= 1
        if labels[b] == 0:  # IsNext: B continues A in the same piece
            assert seg_b == piece[len(a):len(a) + len(seg_b)]
        else:  # NotNext: a contiguous segment of another row's piece
            assert seg_b and seg_b[0] // 100 != a[0] // 100
            assert seg_b == list(range(seg_b[0], seg_b[0] + len(seg_b)))
    with pytest.raises(lmkit.errors.LmkitError, match="--batch-size 2 or more"):
        sentence_pairs(rows[:1], CLS, SEP, PAD, 23, g)


def test_masking_skips_cls_sep_and_padding_and_weights_nsp_per_pair():
    task = MaskedLMNextSentence(MASK, 5000, (MASK, BOS, PAD), CLS, SEP)
    pieces = [list(range(100 * (i + 1), 100 * (i + 1) + 40)) for i in range(64)]
    batch = task.build_batch(packed_rows(pieces, 33), PAD, torch.Generator().manual_seed(1))
    chosen = batch["labels"] != IGNORE_INDEX
    original = torch.where(chosen, batch["labels"], batch["input_ids"])
    assert not chosen[torch.isin(original, torch.tensor([CLS, SEP, PAD]))].any()
    assert 0.10 < chosen[batch["attention_mask"].bool()].float().mean() < 0.20
    torch.testing.assert_close(batch["nsp_weight"], torch.full((64,), chosen.sum().item() / 64))


def test_combined_loss_equals_bert_for_pretraining_on_the_same_batch(tmp_path):
    """sum / count of one step, however it is cut into micro-batches = BertForPreTraining's loss (mean MLM CE +
    mean NSP CE) on the same inputs, token types and labels."""
    transformers = pytest.importorskip("transformers")
    cfg = get_preset("bert-tiny", vocab_size=997, d_model=32, n_heads=2, d_ff=64, max_seq_len=40,
                     extra={"head": "pretraining"})
    torch.manual_seed(0)
    ours = build_model(cfg).eval()
    ours.save_pretrained(tmp_path)
    hf = transformers.BertForPreTraining.from_pretrained(tmp_path).eval()
    task = MaskedLMNextSentence(MASK, 997, (MASK, BOS, PAD), CLS, SEP)
    g = torch.Generator().manual_seed(3)
    pieces = [torch.randint(10, 997, (int(n),), generator=g).tolist() for n in torch.randint(2, 60, (11,), generator=g)]
    batch = task.build_batch(packed_rows(pieces, 38), PAD, torch.Generator().manual_seed(4))
    with torch.no_grad():
        ref = hf(batch["input_ids"], attention_mask=batch["attention_mask"], token_type_ids=batch["token_type_ids"],
                 labels=batch["labels"], next_sentence_label=batch["next_sentence_label"]).loss
        count = int((batch["labels"] != IGNORE_INDEX).sum())
        whole = task.loss(ours, batch)[0]
        parts = [task.loss(ours, {k: v[s:s + 4] for k, v in batch.items()})[0].sum for s in range(0, 11, 4)]
    torch.testing.assert_close(whole.sum / count, ref, atol=1e-5, rtol=1e-5)
    torch.testing.assert_close(sum(parts) / count, ref, atol=1e-5, rtol=1e-5)


def test_mlm_nsp_run_reports_masked_and_nsp_accuracy_and_eval_prints_them(corpus_file, tmp_path, capsys):
    transformers = pytest.importorskip("transformers")
    from lmkit.cli import main

    out = tmp_path / "run"
    cfg = TrainConfig(preset="bert-tiny", objective="mlm-nsp", corpus=[corpus_file], out=str(out), max_steps=30,
                      batch_size=16, seq_len=32, lr=2e-3, warmup_steps=2, vocab_size=400, precision="fp32",
                      progress=False, eval_every=30, val_fraction=0.2)
    trainer = Trainer(cfg)
    before = trainer.evaluate()
    result = trainer.fit()
    rows = [json.loads(line) for line in (out / "metrics.jsonl").read_text().splitlines()]
    assert rows[-1]["loss"] < rows[0]["loss"]
    last = rows[-1]
    assert {"val_masked_loss", "val_masked_accuracy", "val_nsp_loss", "val_nsp_accuracy"} <= set(last)
    assert "val_bpb" not in last and "val_ppl" not in last
    assert last["val_loss"] == pytest.approx(last["val_masked_loss"] + last["val_nsp_loss"])
    assert result["val_masked_loss"] < before["masked_loss"] - 0.5  # 6.00 -> 5.00 on this fixed split
    assert 0 <= result["val_nsp_accuracy"] <= 1
    hf = transformers.BertForPreTraining.from_pretrained(out)  # BERT's pre-training head, as transformers reads it
    assert hf.config.type_vocab_size == 2 and lmkit.load_model(out).head == "pretraining"
    capsys.readouterr()
    assert main(["eval", "--model", str(out)]) == 0
    text = capsys.readouterr().out
    printed = {line[:15].strip(): float(line[15:].split()[0]) for line in text.splitlines()[1:]}
    assert printed["masked acc"] == pytest.approx(result["val_masked_accuracy"], abs=1e-4)
    assert printed["nsp acc"] == pytest.approx(result["val_nsp_accuracy"], abs=1e-4)
    assert "perplexity" not in text and "bits per byte" not in text
