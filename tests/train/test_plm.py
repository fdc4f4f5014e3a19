"""Permutation language modeling: the factorization orders and targets, what each stream may see (by gradients),
memory across segments, and `--objective plm` through the trainer into a folder transformers reads."""
from __future__ import annotations

import json

import pytest
import torch

import lmkit
from lmkit.config import get_preset
from lmkit.errors import TrainingError
from lmkit.models import build_model
from lmkit.objectives import IGNORE_INDEX, permutation_lm_inputs
from lmkit.train.config import TrainConfig
from lmkit.train.trainer import Trainer

SMALL = dict(vocab_size=61, d_model=16, n_layers=3, n_heads=2, d_ff=24, dropout=0.0, attention_dropout=0.0,
             activation_dropout=0.0, mem_len=None)
CORPUS_DOCS = 40


def _model(**overrides):
    torch.manual_seed(0)
    return build_model(get_preset("xlnet-tiny", **{**SMALL, **overrides})).eval()


def _ranks(perm_mask: torch.Tensor, targets: torch.Tensor) -> dict[int, int]:
    """Each target's place in the order: the number of targets it sees."""
    return {int(i): int((perm_mask[i, targets] == 0).sum()) for i in targets}


def test_orders_targets_and_visibility():
    g = torch.Generator().manual_seed(0)
    B, T = 6, 48
    ids = torch.randint(3, 60, (B, T), generator=g)
    ids[:, 0] = 1  # a special token at the start of each row
    mask = torch.ones(B, T, dtype=torch.long)
    mask[1, -10:] = 0
    batch = permutation_lm_inputs(ids, mask, special_ids=(1,), perm_size=16, generator=g)
    pm, tm, labels = batch["perm_mask"], batch["target_mapping"], batch["labels"]
    assert tm.shape == (B, 8, T) and labels.shape == (B, 8)  # K = 6: 48 / 6 targets
    runs = 0
    for b in range(B):
        targets = torch.nonzero(tm[b].sum(0)).flatten()
        assert len(targets) == 8 and 0 not in targets.tolist()  # special tokens are never targets
        assert not (mask[b, targets] == 0).any()  # padding is never a target
        assert torch.equal(labels[b], ids[b, tm[b].argmax(-1)])
        hidden = torch.zeros(T, dtype=torch.bool)
        hidden[targets] = True
        hidden[0] = True  # the special token is revealed in order too, never predicted
        assert (pm[b][:, ~hidden] == 0).all()  # non-targets are visible to every position
        assert (pm[b][~hidden][:, hidden] == 1).all()  # ... and see no target
        assert (pm[b, targets, targets] == 1).all()  # a target's query never sees itself
        ranks = _ranks(pm[b], targets)
        assert sorted(ranks.values()) == list(range(8))  # a strict total order of the targets
        assert [ranks[int(t)] for t in tm[b].argmax(-1)] == list(range(8))  # predictions listed in that order
        for i in targets.tolist():  # blocks of perm_size come in turn: every target of an earlier block is seen
            for j in targets.tolist():
                if j // 16 < i // 16:
                    assert pm[b, i, j] == 0
        runs += sum(1 for t in targets.tolist() if t + 1 in targets.tolist())
    assert runs > 0  # spans: neighbouring targets
    again = permutation_lm_inputs(ids, mask, special_ids=(1,), perm_size=16, generator=torch.Generator().manual_seed(9))
    assert not torch.equal(again["perm_mask"], pm)  # a fresh order per draw


def test_fraction_of_targets_is_one_sixth():
    ids = torch.randint(3, 60, (4, 300), generator=torch.Generator().manual_seed(1))
    batch = permutation_lm_inputs(ids, generator=torch.Generator().manual_seed(2))
    assert batch["labels"].shape[1] == 50 and (batch["labels"] != IGNORE_INDEX).all()


def test_a_target_gets_no_gradient_from_itself_or_later_tokens_in_its_order():
    model = _model()
    g = torch.Generator().manual_seed(3)
    ids = torch.randint(3, 60, (2, 24), generator=g)
    batch = permutation_lm_inputs(ids, special_ids=(), predict_fraction=1 / 3, generator=g)
    embeds = model.get_input_embeddings()(ids).detach().requires_grad_(True)
    out = model(inputs_embeds=embeds, perm_mask=batch["perm_mask"], target_mapping=batch["target_mapping"])
    pm, tm = batch["perm_mask"][0], batch["target_mapping"][0]
    for m in range(tm.shape[0]):
        embeds.grad = None
        logp = out.logits[0, m].log_softmax(-1)[batch["labels"][0, m]]
        logp.backward(retain_graph=True)
        reach = embeds.grad[0].abs().sum(-1)
        i = int(tm[m].argmax())
        hidden = pm[i] == 1
        assert hidden[i] and (reach[hidden] == 0).all()  # itself and every token later in its order
        assert (reach[~hidden] > 0).all()  # everything else reaches it (3 layers, no dropout)
        assert (embeds.grad[1] == 0).all()  # nor across rows


def test_content_stream_sees_itself_query_stream_does_not():
    model = _model(n_layers=1)
    g = torch.Generator().manual_seed(4)
    ids = torch.randint(3, 60, (1, 12), generator=g)
    batch = permutation_lm_inputs(ids, predict_fraction=1 / 4, generator=g)
    i = int(batch["target_mapping"][0, 0].argmax())
    changed = ids.clone()
    changed[0, i] = (ids[0, i] + 1) % 60
    with torch.no_grad():
        content = [model(x, perm_mask=batch["perm_mask"]).last_hidden_state[0, i] for x in (ids, changed)]
        query = [model(x, perm_mask=batch["perm_mask"], target_mapping=batch["target_mapping"]).logits[0, 0]
                 for x in (ids, changed)]
    assert not torch.allclose(content[0], content[1])
    assert torch.equal(query[0], query[1])


def test_memory_carries_the_previous_segment_and_only_it():
    model = _model(mem_len=9)
    g = torch.Generator().manual_seed(5)
    first, other, second = (torch.randint(3, 60, (2, 10), generator=g) for _ in range(3))
    with torch.no_grad():
        mems = model(first, use_mems=True).mems
        mems_other = model(other, use_mems=True).mems
        alone = model(second).logits
        after = model(second, mems=mems).logits
        after_other = model(second, mems=mems_other).logits
    assert mems[0].shape == (9, 2, 16)  # the last mem_len positions, time-major
    assert not torch.allclose(after, alone) and not torch.allclose(after, after_other)
    embeds = model.get_input_embeddings()(first).detach().requires_grad_(True)
    mems = model(inputs_embeds=embeds, use_mems=True).mems
    assert all(not m.requires_grad for m in mems)  # detached: no gradient reaches the previous segment
    changed = second.clone()
    changed[1] = second[0]
    with torch.no_grad():  # row 0's output depends on row 0's memory only
        torch.testing.assert_close(model(changed, mems=model(first, use_mems=True).mems).logits[0], after[0])


def test_plm_training_learns_and_saves_a_folder_transformers_reads(corpus_file, tmp_path, capsys):
    transformers = pytest.importorskip("transformers")
    cfg = TrainConfig(preset="xlnet-tiny", objective="plm", corpus=[corpus_file], out=str(tmp_path / "x"),
                      max_steps=8, batch_size=8, seq_len=32, lr=3e-3, warmup_steps=1, vocab_size=400,
                      precision="fp32", progress=False, model_overrides=dict(SMALL, vocab_size=400, d_model=32))
    trainer = Trainer(cfg)
    batch = trainer.objective.build_batch(trainer.stream.rows(0, 0, 4), trainer.pad_id, torch.Generator())
    assert batch["input_ids"].shape == (4, 2, 16)  # two consecutive pieces of each row, read in turn over memory
    trainer.fit()
    rows = [json.loads(line) for line in (tmp_path / "x" / "metrics.jsonl").read_text().splitlines()]
    assert rows[-1]["loss"] < rows[0]["loss"] and "val_bpb" in rows[-1]
    ours = lmkit.load_model(tmp_path / "x")
    ref = transformers.XLNetLMHeadModel.from_pretrained(tmp_path / "x").eval()
    ids = torch.randint(0, 400, (2, 9))
    with torch.no_grad():
        torch.testing.assert_close(ours(ids).logits, ref(ids).logits, atol=1e-4, rtol=0)
    from lmkit.cli import main

    capsys.readouterr()
    assert main(["generate", "--model", str(tmp_path / "x"), "--prompt", "The", "--max-new-tokens", "4"]) == 0
    assert capsys.readouterr().out.startswith("The")  # the run's folder generates through the CLI


def test_plm_refuses_a_model_without_two_streams(corpus_file, tmp_path):
    cfg = TrainConfig(preset="bert-tiny", objective="plm", corpus=[corpus_file], out=str(tmp_path / "b"),
                      max_steps=1, batch_size=4, seq_len=32, vocab_size=400, progress=False)
    with pytest.raises(TrainingError, match="position 'xl'"):
        Trainer(cfg)
