"""A --time-budget run of the default preset sized from a scaling law: the walk along the ridge finds the shape
an exhaustive search finds, the chosen shape is what trains and what a resumed run keeps, and sizing is off
wherever it cannot apply."""
import json
import math

import pytest

from lmkit.cli import build_parser
from lmkit.cli.train import config_from_args
from lmkit.errors import ConfigError
from lmkit.scaling.laws import BESIROGLU, CHINCHILLA, PYDOCS, ScalingLaw
from lmkit.train import TrainConfig, Trainer
from lmkit.train import sizing
from lmkit.train.sizing import MIN_STEPS, choose, ridge_shape

CORPUS_DOCS = 40


def synthetic_measure(fixed: float, per_param: float, calls: list):
    """(N, tokens/s) of a ridge shape: N as the default preset's 12 d^2-ish per layer, a step time of
    fixed + per_param * (N + the embedding the law leaves out)."""
    def measure(shape):
        calls.append(shape.n_layers)
        n = 11 * shape.n_layers * shape.d_model ** 2
        seconds_per_token = fixed + per_param * (n + 4096 * shape.d_model)
        return n, 1.0 / seconds_per_token
    return measure


def exhaustive(law: ScalingLaw, budget: float, tokens_per_step: int, measure, max_layers: int):
    def key(layers):
        n, rate = measure(ridge_shape(layers))
        loss = law.loss(n, rate * budget) if rate * budget >= MIN_STEPS * tokens_per_step else math.inf
        return (loss, 1 / rate)
    return min(range(1, max_layers + 1), key=key)


@pytest.mark.parametrize("law", [PYDOCS, CHINCHILLA, BESIROGLU])
@pytest.mark.parametrize("budget", [5.0, 60.0, 300.0, 3600.0, 86400.0])
@pytest.mark.parametrize("start", [1, 4, 9])
def test_the_walk_finds_the_ridges_best_shape(law, budget, start):
    calls = []
    measure = synthetic_measure(2e-5, 2e-11, calls)
    best, measured = choose(law, budget, 3072, start, measure, max_layers=16)
    assert best.shape.n_layers == exhaustive(law, budget, 3072, synthetic_measure(2e-5, 2e-11, []), 16)
    assert len(calls) == len(set(calls)) == len(measured)  # each shape measured once
    for c in measured:  # every prediction is the law at the measured tokens of the budget
        n, rate = synthetic_measure(2e-5, 2e-11, [])(c.shape)
        assert (c.n_params, c.tokens_per_second) == (n, pytest.approx(rate))
        if c.predicted_loss < math.inf:
            assert c.predicted_loss == pytest.approx(law.loss(n, rate * budget))
    # the chosen shape is a local minimum: both neighbours (where they exist) were measured and are no better
    for layers in (best.shape.n_layers - 1, best.shape.n_layers + 1):
        if 1 <= layers <= 16:
            assert layers in calls


def test_longer_budgets_size_larger_models():
    sizes = [choose(PYDOCS, b, 3072, 4, synthetic_measure(2e-5, 2e-11, []))[0].n_params
             for b in (60, 300, 3600, 86400)]
    assert sizes == sorted(sizes) and sizes[0] < sizes[-1]


def test_a_budget_too_short_for_any_shape_walks_to_the_fastest():
    best, _ = choose(PYDOCS, 1e-3, 3072, 4, synthetic_measure(2e-5, 2e-11, []))
    assert best.shape.n_layers == 1 and best.predicted_loss == math.inf


def small(corpus_file, out, **kw):
    return TrainConfig(**{**dict(corpus=[corpus_file], out=str(out), batch_size=4, seq_len=32, precision="fp32",
                                 progress=False, save_every=None), **kw})


def test_a_time_budget_run_trains_the_sized_shape_and_a_resume_keeps_it(corpus_file, tmp_path):
    out = tmp_path / "run"
    trainer = Trainer(small(corpus_file, out, time_budget=4.0))
    s = trainer.sizing
    assert s is not None and s.law == "pydocs" and s.budget == 4.0
    chosen = s.chosen.shape
    assert (trainer.model_config.n_layers, trainer.model_config.d_model) == (chosen.n_layers, chosen.d_model)
    assert trainer.cfg.model_overrides == chosen.overrides()
    assert s.chosen == min(s.measured, key=lambda c: (c.predicted_loss, 1 / c.tokens_per_second))
    assert ridge_shape(4) in {c.shape for c in s.measured}  # the walk starts at the preset (4x256)
    assert not out.exists()  # measuring wrote nothing
    trainer.fit()
    config = json.loads((out / "config.json").read_text())
    assert (config["num_hidden_layers"], config["hidden_size"]) == (chosen.n_layers, chosen.d_model)
    steps = [json.loads(line)["step"] for line in (out / "metrics.jsonl").read_text().splitlines()]
    assert steps[0] >= 1 and steps == sorted(set(steps))  # the measuring steps left no rows
    resumed = Trainer(small(corpus_file, out, time_budget=6.0, resume=True))
    assert resumed.sizing is None
    assert (resumed.model_config.n_layers, resumed.model_config.d_model) == (chosen.n_layers, chosen.d_model)


@pytest.mark.parametrize("changes", [dict(sizing="off"), dict(time_budget=None, max_steps=2),
                                     dict(preset="tiny"), dict(model_overrides={"n_layers": 2})])
def test_no_sizing_where_it_does_not_apply(corpus_file, tmp_path, changes):
    cfg = small(corpus_file, tmp_path / "run", **{"time_budget": 4.0, **changes}).resolved()
    assert not sizing.applies(cfg, world_size=1)


def test_no_sizing_under_torchrun_and_bad_laws_refused(corpus_file, tmp_path):
    cfg = small(corpus_file, tmp_path / "run", time_budget=4.0).resolved()
    assert sizing.applies(cfg, world_size=1) and not sizing.applies(cfg, world_size=2)
    with pytest.raises(ConfigError, match="neither"):
        sizing.applies(small(corpus_file, tmp_path / "r", time_budget=4.0, sizing="nope").resolved(), 1)
    with pytest.raises(ConfigError, match="only a one-process --time-budget run of the default preset"):
        sizing.applies(small(corpus_file, tmp_path / "r", max_steps=3, sizing="chinchilla").resolved(), 1)
    assert sizing.applies(small(corpus_file, tmp_path / "r", time_budget=4.0, sizing="chinchilla").resolved(), 1)


def test_a_named_preset_on_the_command_line_trains_as_it_is():
    parse = build_parser().parse_args
    assert config_from_args(parse(["train", "--time-budget", "60"]))[0].sizing == "auto"
    assert config_from_args(parse(["train", "--time-budget", "60", "--preset", "default"]))[0].sizing == "off"
    cfg, _ = config_from_args(parse(["train", "--preset", "default", "--sizing", "besiroglu", "--time-budget", "60"]))
    assert cfg.sizing == "besiroglu"
