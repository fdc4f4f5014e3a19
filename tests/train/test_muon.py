"""Muon for the hidden matrices + AdamW for the rest (train/muon.py): the math, the split, and the trainer."""
import copy
import json

import pytest
import torch

from lmkit.config import get_preset
from lmkit.errors import TrainingError
from lmkit.models import build_model
from lmkit.train import Trainer
from lmkit.train.config import TrainConfig, bf16_supported
from lmkit.train.muon import MuonAdamW, hidden_matrices, newton_schulz, newton_schulz_dtype
from lmkit.train.optim import param_groups
from lmkit.train.resume import resume_config


def _loss(model, x):
    return torch.nn.functional.cross_entropy(model(x[:, :-1]).logits.flatten(0, 1), x[:, 1:].flatten())


@pytest.mark.bf16
@pytest.mark.parametrize("preset", ["tiny", "default"])
def test_equals_torch_muon_and_adamw(preset):
    """Five steps with Newton-Schulz in bf16 equal torch.optim.Muon(adjust_lr_fn="match_rms_adamw") (bf16 too) on
    the hidden matrices plus torch's AdamW."""
    torch.manual_seed(0)
    ours = build_model(get_preset(preset, n_layers=2, d_model=64, n_heads=4, n_kv_heads=2 if preset == "default"
                                  else None, vocab_size=97, max_seq_len=16, dropout=0.0))
    ref = copy.deepcopy(ours)
    opt = MuonAdamW(ours, 3e-3, 0.1, ns_dtype=torch.bfloat16)
    hidden = hidden_matrices(ref)
    refs = [torch.optim.Muon(hidden, lr=3e-3, weight_decay=0.1, adjust_lr_fn="match_rms_adamw"),
            torch.optim.AdamW(param_groups(ref, 0.1, skip={id(p) for p in hidden}), lr=3e-3, betas=(0.9, 0.95))]
    x = torch.randint(0, 97, (3, 13))
    for _ in range(5):
        for model, opts in ((ours, [opt]), (ref, refs)):
            _loss(model, x).backward()
            for o in opts:
                o.step()
                o.zero_grad()
    for (name, a), b in zip(ours.named_parameters(), ref.parameters()):
        assert torch.equal(a, b), name


def test_hidden_matrices_are_the_block_linears_only():
    model = build_model(get_preset("tiny", vocab_size=97))
    hidden = {id(p) for p in hidden_matrices(model)}
    names = {n for n, p in model.named_parameters() if id(p) in hidden}
    assert names and all(".layers." in f".{n}" and n.endswith(".weight") for n in names)
    assert all(model.get_parameter(n).ndim == 2 for n in names)
    # embeddings (tied to the head), norms and biases stay with AdamW, each parameter in exactly one group
    opt = MuonAdamW(model, 1e-3)
    ids = [id(p) for g in opt.param_groups for p in g["params"]]
    assert len(ids) == len(set(ids)) == len({id(p) for p in model.parameters()})
    assert {id(p) for g in opt.param_groups if g["muon"] for p in g["params"]} == hidden
    # an untied head and its embedding table stay with AdamW; every projection of every block goes to Muon
    untied = build_model(get_preset("default", n_layers=2, d_model=32, n_heads=4, n_kv_heads=2, vocab_size=97,
                                    tie_embeddings=False))
    hidden = {id(p) for p in hidden_matrices(untied)}
    assert id(untied.lm_head.weight) not in hidden and id(untied.decoder.embeddings.tokens.weight) not in hidden
    assert len(hidden) == sum(isinstance(m, torch.nn.Linear) for m in untied.modules()) - 1


@pytest.mark.bf16
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float32])
def test_newton_schulz_keeps_the_singular_vectors_and_flattens_the_singular_values(dtype):
    """NS_5(G) ~ U S' V^T with S' in about [0.68, 1.2] for G = U S V^T, wide or tall, in either precision."""
    torch.manual_seed(0)
    for shape in ((24, 40), (40, 24)):
        g = torch.randn(shape) @ torch.diag(torch.logspace(-1, 1, shape[1]))
        u, s, vh = torch.linalg.svd(g, full_matrices=False)
        o = newton_schulz(g, dtype=dtype)
        assert o.dtype == dtype
        o = o.float()
        inner = u.T @ o @ vh.T  # diagonal S' if the singular vectors are kept
        assert (inner - torch.diag(torch.diagonal(inner))).abs().max() < 0.05
        assert torch.diagonal(inner).min() > 0.6 and torch.diagonal(inner).max() < 1.25
        assert s.max() / s.min() > 50  # while G's singular values spread over almost two orders of magnitude


@pytest.mark.bf16
def test_newton_schulz_runs_in_bf16_only_where_bf16_is_native():
    """fp32 where bf16 matrix products are emulated (slower than fp32 there); there it is the float64 iteration's
    result to fp32 rounding, which bf16 (8 significant bits) is not."""
    native = bf16_supported()
    assert newton_schulz_dtype() == (torch.bfloat16 if native else torch.float32)
    assert newton_schulz(torch.randn(8, 12)).dtype == newton_schulz_dtype()
    assert MuonAdamW(build_model(get_preset("tiny", vocab_size=97)), 1e-3).ns_dtype is None  # resolved per step
    torch.manual_seed(0)
    g = torch.randn(48, 80)
    exact = newton_schulz(g.double(), dtype=torch.float64)
    fp32_err = (newton_schulz(g, dtype=torch.float32).double() - exact).abs().max().item()
    bf16_err = (newton_schulz(g, dtype=torch.bfloat16).double() - exact).abs().max().item()
    assert fp32_err < 1e-4 < bf16_err


def test_the_default_recipe_trains_with_muon_and_others_with_adamw():
    assert TrainConfig(preset="default").resolved().optimizer == "muon"
    assert TrainConfig(preset="tiny").resolved().optimizer == "adamw"
    assert TrainConfig(preset="default", optimizer="adamw").resolved().optimizer == "adamw"
    with pytest.raises(TrainingError, match="--optimizer must be one of adamw, muon"):
        TrainConfig(preset="tiny", optimizer="sgd").resolved()


def test_a_run_saved_before_the_setting_existed_resumes_with_adamw():
    saved = {k: v for k, v in TrainConfig(preset="default", out="x").to_dict().items() if k != "optimizer"}
    assert resume_config(TrainConfig(out="x", resume=True), saved, set()).resolved().optimizer == "adamw"


def test_a_run_saved_before_the_setting_existed_accepts_its_own_optimizer_and_refuses_the_other():
    saved = {k: v for k, v in TrainConfig(preset="default", out="x").to_dict().items() if k != "optimizer"}
    given = TrainConfig(out="x", resume=True, optimizer="adamw")
    assert resume_config(given, saved, {"optimizer"}).resolved().optimizer == "adamw"
    assert resume_config(given, saved, None).resolved().optimizer == "adamw"  # the Python API
    with pytest.raises(TrainingError, match=r"--optimizer muon differs from the run being resumed \(adamw\)"):
        resume_config(TrainConfig(out="x", resume=True, optimizer="muon"), saved, {"optimizer"})


def test_a_default_run_saved_before_muon_resumes_without_the_dropout_it_never_had():
    from lmkit.config import get_preset

    new = TrainConfig(preset="default", out="x").to_dict()
    old = {k: v for k, v in new.items() if k != "optimizer"}
    resumed = resume_config(TrainConfig(out="x", resume=True), old, set())
    assert get_preset(resumed.preset, **resumed.model_overrides).dropout == 0.0
    kept = resume_config(TrainConfig(out="x", resume=True), {**new, "optimizer": "muon"}, set())
    assert get_preset(kept.preset, **kept.model_overrides).dropout == 0.1
    tiny = resume_config(TrainConfig(out="x", resume=True), {**old, "preset": "tiny"}, set())
    assert tiny.model_overrides == {}
    # the Python API resuming with the overrides the run was given: not a change, though dropout 0 is added
    given = {"n_layers": 1}
    again = resume_config(TrainConfig(out="x", resume=True, model_overrides=given), {**old, "model_overrides": given},
                          None)
    assert again.model_overrides == {"dropout": 0.0, "n_layers": 1}
    with pytest.raises(TrainingError, match=r"TrainConfig.model_overrides \{'n_layers': 2\} differs"):
        resume_config(TrainConfig(out="x", resume=True, model_overrides={"n_layers": 2}),
                      {**old, "model_overrides": given}, None)


@pytest.mark.bf16  # Newton-Schulz in bf16 or fp32 by the CPU
def test_muon_runs_resume_exactly(tmp_path, small_pydocs):
    import shutil

    small_pydocs(tmp_path / "c.jsonl", 30)
    cfg = dict(preset="tiny", corpus=[str(tmp_path / "c.jsonl")], out=str(tmp_path / "run"), max_steps=4, batch_size=4,
               seq_len=32, log_every=1, save_every=2, precision="fp32", optimizer="muon", progress=False)

    def losses():
        return [(r["step"], r["loss"]) for r in map(json.loads, (tmp_path / "run" / "metrics.jsonl").read_text().splitlines())]

    Trainer(TrainConfig(**cfg)).fit()
    whole = losses()
    state = json.loads((tmp_path / "run" / "checkpoint" / "step-00000004" / "state.json").read_text())
    assert [g["muon"] for g in state["optimizer"]["param_groups"]][:2] == [True, False]
    shutil.rmtree(tmp_path / "run" / "checkpoint" / "step-00000004")  # back to the save of step 2
    Trainer(TrainConfig(**cfg, resume=True)).fit()
    assert losses() == whole and len(whole) == 4


def test_each_rank_draws_its_own_dropout_and_rank_0_that_of_one_process():
    from lmkit.train.seeds import seed_int, train_seed

    assert train_seed(7, 0) == seed_int("train", 7)  # one-process runs keep their numbers
    assert len({train_seed(7, r) for r in range(4)}) == 4
    masks = []
    for r in range(2):
        torch.manual_seed(train_seed(7, r))
        masks.append(torch.nn.functional.dropout(torch.ones(64), 0.1, training=True))
    assert not torch.equal(*masks)
