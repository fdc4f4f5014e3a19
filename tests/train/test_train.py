"""The trainer: schedule, decay groups, accumulation, determinism, exact resume, errors, outputs."""
import json
import math

import pytest
import torch

from lmkit.config import get_preset
from lmkit.data import load_corpus
from lmkit.errors import TrainingError
from lmkit.models import CausalLM
from lmkit.train import TrainConfig, Trainer
from lmkit.train.loop import TrainLoop
from lmkit.train.optim import lr_at, param_groups
CORPUS_DOCS, CORPUS_IDS = 40, True  # the corpus_file fixture (conftest.py): about 60 KB of pydocs


def config(corpus_file, out, **kw):
    settings = dict(preset="tiny", corpus=[corpus_file], out=str(out), max_steps=6, batch_size=4, seq_len=32,
                    precision="fp32", log_every=1, save_every=3, progress=False, warmup_steps=2)
    settings.update(kw)
    return TrainConfig(**settings)


def losses(out):
    rows = [json.loads(line) for line in (out / "metrics.jsonl").read_text().splitlines()]
    return [(r["step"], r["loss"], r.get("val_loss")) for r in rows]


# schedule and optimizer groups -------------------------------------------------------------------

def test_warmup_then_cosine_values():
    kw = dict(max_lr=1.0, warmup_steps=10, total_steps=110, min_lr=0.1)
    assert [lr_at(s, **kw) for s in range(3)] == pytest.approx([0.1, 0.2, 0.3])      # (s + 1) / W
    assert lr_at(9, **kw) == pytest.approx(1.0)                                      # peak after warm-up
    assert lr_at(10, **kw) == pytest.approx(1.0)
    assert lr_at(60, **kw) == pytest.approx(0.55)                                    # half way: (max + min) / 2
    assert lr_at(35, **kw) == pytest.approx(0.1 + 0.9 * (1 + math.cos(math.pi / 4)) / 2)
    assert lr_at(110, **kw) == pytest.approx(0.1) and lr_at(500, **kw) == pytest.approx(0.1)
    values = [lr_at(s, **kw) for s in range(10, 111)]
    assert all(a >= b for a, b in zip(values, values[1:]))                           # monotone decay


def test_default_warmup_is_the_presets_capped_at_a_tenth_of_the_planned_steps():
    """`lmkit train --max-steps 40` warmed up over 50 steps and never reached the peak lr; a warm-up left out is now
    at most a tenth of the steps, one given is used as given, and the 5-minute demo (about 600 steps) keeps 50."""
    default, tiny, t5 = (TrainConfig(preset=p) for p in ("default", "tiny", "t5-tiny"))
    assert [default.warmup_for(n) for n in (40, 600, 10_000, None)] == [4, 50, 50, 50]
    assert [tiny.warmup_for(n) for n in (8, 40, 100, 1000)] == [0, 4, 10, 10]
    assert [t5.warmup_for(n) for n in (40, 1000, 5000)] == [4, 100, 100]
    assert TrainConfig(preset="default", warmup_steps=30).warmup_for(40) == 30
    assert TrainConfig(preset="tiny").resolved().warmup_steps is None  # fixed once the steps are planned
    # lr_at with the warm-up at or past the run's length: the ramp never reaches the peak before the last step
    assert max(lr_at(s, 1.0, 50, 40) for s in range(40)) == pytest.approx(40 / 50)
    assert max(lr_at(s, 1.0, 4, 40) for s in range(40)) == 1.0


def test_left_out_warmup_is_fixed_from_the_planned_steps_and_recorded(corpus_file, tmp_path):
    """A run without a warm-up reaches the peak (tiny: 10 preset steps, 6 planned: none) and records the warm-up it
    used; a resumed run keeps the recorded one, also a run saved before the cap (its preset's 10)."""
    def lrs(out):
        return [r["lr"] for r in map(json.loads, (out / "metrics.jsonl").read_text().splitlines())]

    peak, floor = 3e-3, 3e-4  # tiny's recipe, min_lr_ratio 0.1
    Trainer(config(corpus_file, tmp_path / "a", warmup_steps=None)).fit()
    assert lrs(tmp_path / "a") == pytest.approx([lr_at(s, peak, 0, 6, floor) for s in range(6)])
    assert lrs(tmp_path / "a")[0] == peak
    out = tmp_path / "b"
    Trainer(config(corpus_file, out, warmup_steps=None)).fit()
    ckpt = _back_to_step_3(out)
    assert json.loads((ckpt / "state.json").read_text())["train_config"]["warmup_steps"] == 0
    Trainer(TrainConfig(out=str(out), resume=True, max_steps=40, progress=False, save_every=40)).fit()
    assert lrs(out) == pytest.approx([lr_at(s, peak, 0, 6, floor) for s in range(3)]
                                     + [lr_at(s, peak, 0, 40, floor) for s in range(3, 40)])  # not 40 // 10 = 4
    out = tmp_path / "old"
    Trainer(config(corpus_file, out, warmup_steps=None)).fit()
    _back_to_step_3(out, lambda state: state["train_config"].update(warmup_steps=10))  # as runs saved before
    Trainer(config(corpus_file, out, warmup_steps=None, resume=True), explicit=set()).fit()
    assert lrs(out)[3:] == pytest.approx([lr_at(s, peak, 10, 6, floor) for s in range(3, 6)])


def test_lr_schedule_constant_holds_lr_after_warmup_and_resume_keeps_it(corpus_file, tmp_path):
    """`lmkit train --lr-schedule constant`: metrics.jsonl's lr rises over the warm-up, then stays at --lr; the
    schedule is recorded in the checkpoint, so --resume keeps it (another one is refused), and a checkpoint saved
    before the flag existed resumes with cosine."""
    from lmkit.cli import main

    def lrs(out):
        return [r["lr"] for r in map(json.loads, (out / "metrics.jsonl").read_text().splitlines())]

    def train(out, *extra):
        return main(["train", "--preset", "tiny", "--corpus", corpus_file, "--out", str(out), "--batch-size", "4",
                     "--seq-len", "32", "--precision", "fp32", "--log-every", "1", "--save-every", "3",
                     "--warmup-steps", "2", "--lr", "2e-3", *extra])

    out = tmp_path / "constant"
    assert train(out, "--max-steps", "6", "--lr-schedule", "constant") == 0
    assert lrs(out) == pytest.approx([1e-3, 2e-3, 2e-3, 2e-3, 2e-3, 2e-3])
    ckpt = _back_to_step_3(out)
    assert json.loads((ckpt / "state.json").read_text())["train_config"]["lr_schedule"] == "constant"
    assert train(out, "--max-steps", "8", "--resume") == 0
    assert lrs(out) == pytest.approx([1e-3] + [2e-3] * 7)
    with pytest.raises(TrainingError, match="--lr-schedule cosine differs from the run being resumed"):
        Trainer(config(corpus_file, out, resume=True, lr_schedule="cosine"), explicit={"lr_schedule"})

    out = tmp_path / "old"  # saved before --lr-schedule: its train config has none, and reads as cosine
    assert train(out, "--max-steps", "6") == 0
    assert json.loads((out / "checkpoint" / "step-00000006" / "state.json").read_text()
                      )["train_config"]["lr_schedule"] == "cosine"
    _back_to_step_3(out, lambda state: state["train_config"].pop("lr_schedule"))
    assert train(out, "--max-steps", "6", "--resume") == 0
    assert lrs(out) == pytest.approx([lr_at(s, 2e-3, 2, 6, 2e-4) for s in range(6)])
    with pytest.raises(TrainingError, match="--lr-schedule must be one of linear, cosine, constant"):
        config(corpus_file, tmp_path / "bad", lr_schedule="step").resolved()


@pytest.mark.parametrize("preset", ["tiny", "default"])
def test_no_decay_on_biases_norms_and_embeddings(preset):
    model = CausalLM(get_preset(preset, vocab_size=128, n_layers=1))
    decay, keep = param_groups(model, 0.1)
    assert decay["weight_decay"] == 0.1 and keep["weight_decay"] == 0.0
    names = {id(p): n for n, p in model.named_parameters()}
    decayed = {names[id(p)] for p in decay["params"]}
    kept = {names[id(p)] for p in keep["params"]}
    assert not decayed & kept and len(decayed) + len(kept) == len(names)            # each parameter once (tied head)
    assert all(n.endswith(".weight") and "norm" not in n and "embed" not in n for n in decayed)
    assert any("q_proj" in n for n in decayed)
    assert all(n.endswith("bias") or "norm" in n or "embeddings" in n for n in kept)
    assert any("embeddings" in n for n in kept)


# the loop ----------------------------------------------------------------------------------------

def test_accumulation_equals_a_bigger_batch(corpus_file, tmp_path):
    whole = Trainer(config(corpus_file, tmp_path / "a", batch_size=8))
    accum = Trainer(config(corpus_file, tmp_path / "b", batch_size=8, micro_batch_size=2))
    assert whole.train_step(0) == pytest.approx(accum.train_step(0), rel=1e-6)
    # Adam's first step moves every weight by about lr (1.5e-3 here) whatever its gradient's size, so a gradient
    # near zero summed in another order may move a weight a little differently: 1e-5 is 1% of a step
    for p, q in zip(whole.model.parameters(), accum.model.parameters()):
        torch.testing.assert_close(p, q, rtol=1e-5, atol=1e-5)


def test_same_flags_and_seed_give_the_same_run(corpus_file, tmp_path):
    r1 = Trainer(config(corpus_file, tmp_path / "a")).fit()
    r2 = Trainer(config(corpus_file, tmp_path / "b")).fit()
    assert losses(tmp_path / "a") == losses(tmp_path / "b")
    assert r1["val_loss"] == r2["val_loss"]
    r3 = Trainer(config(corpus_file, tmp_path / "c", seed=1)).fit()
    assert r3["val_loss"] != r1["val_loss"]


@pytest.mark.parametrize("precision", ["fp32", pytest.param("bf16", marks=pytest.mark.bf16)])
def test_killed_run_resumes_with_identical_losses(corpus_file, tmp_path, precision, monkeypatch):
    straight = Trainer(config(corpus_file, tmp_path / "a", precision=precision, preset="tiny",
                              model_overrides={"dropout": 0.1}))
    straight.fit()

    killed = Trainer(config(corpus_file, tmp_path / "b", precision=precision, model_overrides={"dropout": 0.1}))
    original = Trainer.train_step

    def dies_at_step_5(self, step):
        if step == 4:  # after the checkpoint of step 3, part-way to the next one
            raise KeyboardInterrupt
        return original(self, step)

    monkeypatch.setattr(Trainer, "train_step", dies_at_step_5)
    with pytest.raises(KeyboardInterrupt):
        killed.fit()
    monkeypatch.setattr(Trainer, "train_step", original)
    assert [s for s, _, _ in losses(tmp_path / "b")] == [1, 2, 3, 4]
    (tmp_path / "b" / "checkpoint" / ".step-00000006.stale").mkdir()  # as a kill during a save leaves it

    resumed = Trainer(config(corpus_file, tmp_path / "b", precision=precision, resume=True), explicit=set())
    assert resumed.step == 3
    resumed.fit()
    assert losses(tmp_path / "b") == losses(tmp_path / "a")
    for p, q in zip(straight.model.parameters(), resumed.model.parameters()):
        assert torch.equal(p, q)
    # the stale temporary folder is gone; the newest keep_checkpoints (3) saves stay
    assert sorted(p.name for p in (tmp_path / "b" / "checkpoint").iterdir()) == ["latest.json", "step-00000003",
                                                                                 "step-00000006"]


def _back_to_step_3(out, edit=None):
    """Drop the last checkpoint (as if killed after step 3's save); `edit` rewrites its state.json (manifest kept valid)."""
    import hashlib
    import shutil

    shutil.rmtree(out / "checkpoint" / "step-00000006")
    ckpt = out / "checkpoint" / "step-00000003"
    if edit:
        state = json.loads((ckpt / "state.json").read_text())
        edit(state)
        (ckpt / "state.json").write_text(json.dumps(state))
        manifest = json.loads((ckpt / "manifest.json").read_text())
        data = (ckpt / "state.json").read_bytes()
        manifest["files"]["state.json"] = {"size": len(data), "sha256": hashlib.sha256(data).hexdigest()}
        (ckpt / "manifest.json").write_text(json.dumps(manifest))
    return ckpt


def test_resume_rebuilds_the_model_its_checkpoint_records(corpus_file, tmp_path, monkeypatch, capsys):
    """A checkpoint records the full ModelConfig: a preset redefined since (a new lmkit version) changes
    neither the resumed model nor its losses, and the run says what the preset now gives; overrides
    given that differ from the run's are refused."""
    from lmkit.config import PRESETS, ModelConfig

    straight = Trainer(config(corpus_file, tmp_path / "a"))
    straight.fit()
    out = tmp_path / "b"
    Trainer(config(corpus_file, out)).fit()
    ckpt = _back_to_step_3(out)
    assert ModelConfig.from_dict(json.loads((ckpt / "state.json").read_text())["model_config"]) == straight.model_config
    monkeypatch.setitem(PRESETS, "tiny", {**PRESETS["tiny"], "d_ff": 96, "dropout": 0.1})
    with pytest.raises(TrainingError, match="TrainConfig.model_overrides .* differs from the run being resumed"):
        Trainer(config(corpus_file, out, resume=True, model_overrides={"dropout": 0.0}), explicit={"model_overrides"})
    resumed = Trainer(config(corpus_file, out, resume=True), explicit=set())
    assert resumed.model_config == straight.model_config
    assert "preset 'tiny' now gives d_ff=96, dropout=0.1; the resumed run keeps the model its checkpoint records " \
           "(d_ff=None, dropout=0.0)" in capsys.readouterr().err
    resumed.fit()
    assert losses(out) == losses(tmp_path / "a")


def test_checkpoint_without_a_recorded_model_resumes_from_the_preset(corpus_file, tmp_path):
    """Checkpoints written before the ModelConfig was recorded (nor the tokenizer's vocab_size) resume as before."""
    Trainer(config(corpus_file, tmp_path / "a")).fit()
    out = tmp_path / "b"
    Trainer(config(corpus_file, out)).fit()

    def as_before(state):
        del state["model_config"]
        state["train_config"]["vocab_size"] = None

    _back_to_step_3(out, as_before)
    Trainer(config(corpus_file, out, resume=True), explicit=set()).fit()
    assert losses(out) == losses(tmp_path / "a")


def test_python_api_resume_keeps_the_saved_plan_or_takes_a_new_max_steps(corpus_file, tmp_path):
    """TrainConfig(out=..., resume=True): settings left at their defaults are the saved run's (max_steps=None
    continues to its 6 planned steps, not 1000), max_steps given is honoured; a run killed while writing its
    model folder or an atomic file left temporary files, and they go."""
    Trainer(config(corpus_file, tmp_path / "a")).fit()
    out = tmp_path / "b"
    Trainer(config(corpus_file, out)).fit()
    import shutil

    shutil.rmtree(out / "checkpoint" / "step-00000006")  # back to step 3, as if killed after that save
    (out / ".model.k1ll3d").mkdir()
    (out / ".model.k1ll3d" / "model.safetensors").write_bytes(b"half")
    (out / ".metrics.jsonl.x7y.tmp").write_text("half")
    trainer = Trainer(TrainConfig(out=str(out), resume=True, progress=False))
    assert trainer.step == 3 and trainer.total_steps == 6
    assert trainer.fit()["step"] == 6 and losses(out) == losses(tmp_path / "a")
    assert not [p.name for p in out.iterdir() if p.name.startswith(".")]
    assert Trainer(TrainConfig(out=str(out), resume=True, max_steps=8, progress=False)).fit()["step"] == 8
    assert [s for s, _, _ in losses(out)] == [1, 2, 3, 4, 5, 6, 7, 8]


def test_resume_refuses_a_corpus_that_changed_and_follows_one_that_moved(corpus_file, tmp_path):
    """A resumed run retrains its tokenizer from --corpus: a changed corpus would silently give every id another
    meaning, so the checkpoint names its data by content; the same content at another path is fine."""
    from pathlib import Path

    out = tmp_path / "r"
    Trainer(config(corpus_file, out, max_steps=3)).fit()
    text = Path(corpus_file).read_text(encoding="utf-8")
    changed, moved = tmp_path / "changed.jsonl", tmp_path / "moved.jsonl"
    extra = [json.dumps({"id": f"zq-{i}", "text": "zqx vvk zqx " * 300}) for i in range(6)]
    changed.write_text(text + "\n".join(extra) + "\n", encoding="utf-8")
    moved.write_text(text, encoding="utf-8")
    with pytest.raises(TrainingError, match=r"--corpus .*changed.jsonl is not what the run in .* was trained on "
                                            r"\(its tokenizer differs"):
        Trainer(config(str(changed), out, max_steps=6, resume=True), explicit={"corpus", "max_steps"})
    result = Trainer(config(str(moved), out, max_steps=6, resume=True), explicit={"corpus", "max_steps"}).fit()
    assert result["step"] == 6


def test_out_folder_is_a_loadable_model_with_metrics(corpus_file, tmp_path):
    import lmkit

    out = tmp_path / "run"
    result = Trainer(config(corpus_file, out, log_every=2)).fit()
    files = sorted(p.relative_to(out).as_posix() for p in out.rglob("*") if p.is_file())
    assert {"config.json", "model.safetensors", "tokenizer.json", "metrics.jsonl", "loss_curve.png",
            "checkpoint/latest.json"} <= set(files)
    assert all(f.endswith((".json", ".safetensors", ".jsonl", ".png")) for f in files)
    rows = [json.loads(line) for line in (out / "metrics.jsonl").read_text().splitlines()]
    assert [r["step"] for r in rows] == [2, 3, 4, 6]                  # every 2 steps, and each evaluation
    assert all(math.isfinite(r["loss"]) for r in rows)
    assert {"val_loss", "val_bpb"} <= set(rows[1]) and {"val_loss", "val_bpb"} <= set(rows[-1])
    assert rows[-1]["val_loss"] == pytest.approx(result["val_loss"])
    model, tok = lmkit.load_model(out), lmkit.load_tokenizer(out)
    assert model.config.max_seq_len == 32 and model.config.bos_token_id == tok.token_to_id("<|endoftext|>")
    from lmkit.evaluate import evaluate_text

    _, val = load_corpus(corpus_file).split()
    again = evaluate_text(model, tok, val)
    assert again["loss"] == pytest.approx(result["val_loss"], rel=1e-5)
    assert again["bpb"] == pytest.approx(again["loss"] * again["tokens"] / (math.log(2) * again["bytes"]))


def test_default_evaluations_fall_on_the_logged_steps(corpus_file, tmp_path):
    """Without --save-every, the about-ten evaluations of a fixed run come at multiples of --log-every, so
    metrics.jsonl keeps the spacing asked for (it used to add a row at every 1-step evaluation of 12 steps)."""
    out = tmp_path / "run"
    Trainer(config(corpus_file, out, max_steps=12, log_every=5, save_every=None)).fit()
    rows = [json.loads(line) for line in (out / "metrics.jsonl").read_text().splitlines()]
    assert [r["step"] for r in rows] == [5, 10, 12]               # and the last step
    assert all({"val_loss", "val_bpb"} <= set(r) for r in rows)
    assert sorted(p.name for p in (out / "checkpoint").glob("step-*")) == [f"step-{s:08d}" for s in (5, 10, 12)]


def test_time_budget_fixes_a_step_count(corpus_file, tmp_path, monkeypatch):
    plan, planned = TrainLoop._plan, []

    def noted(self, t_start, step_times):
        plan(self, t_start, step_times)
        planned.append(self.total_steps)

    monkeypatch.setattr(TrainLoop, "_plan", noted)
    trainer = Trainer(config(corpus_file, tmp_path / "t", max_steps=None, time_budget=3.0, save_every=None,
                             warmup_steps=None))
    result = trainer.fit()
    assert trainer.total_steps == result["step"] >= 1  # the count depends on the machine's speed
    from lmkit.train.checkpoint import latest_checkpoint

    state = json.loads((latest_checkpoint(tmp_path / "t") / "state.json").read_text())
    assert state["total_steps"] == trainer.total_steps == state["step"]
    # the warm-up left out was capped when the steps were planned (tiny: 10), and recorded for --resume
    first = planned[0] if planned else trainer.total_steps  # out of time before the plan: the steps it made
    assert state["train_config"]["warmup_steps"] == min(10, first // 10)


def test_replanned_time_budget_keeps_its_evaluations_apart(corpus_file, tmp_path, monkeypatch):
    """A run whose step count is re-fitted after each evaluation (the machine got faster) still
    evaluates about `_n_evals` times: the next evaluation comes `every` steps after the last one, not
    at the next multiple of a changed `every` (which used to fall a few steps after an evaluation)."""
    plan, replan = TrainLoop._plan, TrainLoop._replan

    def five_evaluations(self, t_start, step_times):
        plan(self, t_start, step_times)
        self.n_evals = 5

    def faster(self, t_start):
        replan(self, t_start)
        self.total_steps = int(self.total_steps * 1.3)

    monkeypatch.setattr(TrainLoop, "_plan", five_evaluations)
    monkeypatch.setattr(TrainLoop, "_replan", faster)
    trainer = Trainer(config(corpus_file, tmp_path / "t", max_steps=None, time_budget=4.0, save_every=None))
    trainer.fit()
    evaluated = [step for step, _, val in losses(tmp_path / "t") if val is not None]
    assert len(evaluated) >= 3
    assert len(evaluated) <= trainer._n_evals + 2  # the planning evaluation, n_evals spaced ones, the last
    gaps = [b - a for a, b in zip(evaluated[:-1], evaluated[1:-1])]  # the last one comes when the time is up
    assert min(gaps) >= max(gaps) / 4, evaluated


def test_max_steps_below_the_calibration_steps_of_a_time_budget(corpus_file, tmp_path):
    """--max-steps caps a --time-budget run even before the budget's first steps have been timed."""
    result = Trainer(config(corpus_file, tmp_path / "t", max_steps=2, time_budget=600.0, save_every=None)).fit()
    assert result["step"] == 2 and [step for step, _, _ in losses(tmp_path / "t")] == [1, 2]


# errors --------------------------------------------------------------------------------------------

def test_nan_loss_stops_with_a_training_error(corpus_file, tmp_path):
    trainer = Trainer(config(corpus_file, tmp_path / "n"))
    with torch.no_grad():
        trainer.model.lm_head.weight.fill_(float("nan"))
    with pytest.raises(TrainingError, match="loss became nan at step 1"):
        trainer.fit()
    assert not (tmp_path / "n" / "checkpoint").exists()


def test_diverged_run_saves_nothing(corpus_file, tmp_path):
    """An absurd learning rate ruins the weights in one step: the evaluation after it stops the run before
    a checkpoint of those weights is written, and a run that never saved leaves no --out folder behind."""
    with pytest.raises(TrainingError, match="validation loss became nan at step 1; lower --lr"):
        Trainer(config(corpus_file, tmp_path / "n", lr=1e30, save_every=1)).fit()
    assert not (tmp_path / "n").exists()
    (tmp_path / "mine").mkdir()
    (tmp_path / "mine" / "notes.txt").write_text("kept")
    with pytest.raises(TrainingError, match="loss became nan"):
        Trainer(config(corpus_file, tmp_path / "mine", lr=1e30, save_every=1)).fit()
    assert [p.name for p in (tmp_path / "mine").iterdir()] == ["notes.txt"]  # a folder it did not make stays


def test_out_that_is_a_file(corpus_file, tmp_path):
    (tmp_path / "f").write_text("x")
    for out in (tmp_path / "f", tmp_path / "f" / "run"):
        with pytest.raises(TrainingError, match="is a file, not a folder"):
            Trainer(config(corpus_file, out))


def test_resume_and_out_folder_errors(corpus_file, tmp_path):
    with pytest.raises(TrainingError, match="no checkpoint"):
        Trainer(config(corpus_file, tmp_path / "r", resume=True))
    assert not (tmp_path / "r").exists()
    Trainer(config(corpus_file, tmp_path / "r", max_steps=3)).fit()
    with pytest.raises(TrainingError, match="already holds a training run"):
        Trainer(config(corpus_file, tmp_path / "r"))
    with pytest.raises(TrainingError, match="--lr 0.5 differs"):
        Trainer(config(corpus_file, tmp_path / "r", lr=0.5, resume=True), explicit={"lr"})


@pytest.mark.parametrize("objective, message", [("mlm", "not available yet"), ("nope", "unknown objective")])
def test_unknown_objectives(corpus_file, tmp_path, objective, message, monkeypatch):
    from lmkit.train.objectives import OBJECTIVES

    monkeypatch.delitem(OBJECTIVES, "mlm", raising=False)  # as before masked LM was registered
    with pytest.raises(TrainingError, match=message):
        Trainer(config(corpus_file, tmp_path / "o", objective=objective))
    assert not (tmp_path / "o").exists()


def test_objective_must_fit_the_preset(corpus_file, tmp_path):
    from lmkit.train.objectives import OBJECTIVES, Objective, clm_batch, clm_loss

    OBJECTIVES["test-encoder"] = Objective("test-encoder", "encoder", clm_batch, clm_loss, None)
    try:
        with pytest.raises(TrainingError, match="trains encoder models, but preset 'tiny' is decoder"):
            Trainer(config(corpus_file, tmp_path / "o", objective="test-encoder"))
    finally:
        del OBJECTIVES["test-encoder"]


def test_objective_that_does_not_fit_the_recorded_model_names_the_checkpoint(corpus_file, tmp_path):
    """A resumed run rebuilds the model its checkpoint records, so a mismatch names that model_config, not the preset
    (the message said "preset 'tiny' is decoder; pick a matching preset", which no preset could fix)."""
    out = tmp_path / "r"
    Trainer(config(corpus_file, out)).fit()
    ckpt = _back_to_step_3(out, lambda state: state["train_config"].update(objective="span"))
    with pytest.raises(TrainingError) as caught:
        Trainer(config(corpus_file, out, resume=True), explicit=set())
    assert str(caught.value) == (f"--objective span trains encoder-decoder models, but the model recorded in "
                                 f"{ckpt / 'state.json'} (model_config) is decoder; the run's recorded settings do not "
                                 "fit its recorded model; start a new run with another --out")


def test_time_budget_plans_the_steps_that_fit_and_replans_on_the_measured_speed():
    from lmkit.train.budget import planned_steps, replanned_steps

    # 291 s of 97% of 300 left after 10 s: ten evaluations of 1.2 s, and 269 s of 0.5 s steps
    assert planned_steps(8, 10.0, 300.0, 0.5, 1.0, None) == (8 + 538, 10)
    assert planned_steps(8, 10.0, 300.0, 0.5, 1.0, 100) == (100, 10)
    assert planned_steps(8, 10.0, 300.0, 0.5, 30.0, None)[1] == 1  # costly evaluations: fewer of them
    assert planned_steps(8, 299.0, 300.0, 0.5, 1.0, None)[0] == 9  # out of time: still one more step
    assert replanned_steps(10, 20.0, (8, 10.0), 300.0, None) is None  # two steps timed: too few to judge
    # 20 steps in 20 s since planning: 1 s a step, so 264 more fit 98% of 300 (294 s) after 30 s
    assert replanned_steps(28, 20.0 + 10.0, (8, 10.0), 300.0, None) == 28 + 264
    assert replanned_steps(28, 30.0, (8, 10.0), 300.0, 50) == 50
