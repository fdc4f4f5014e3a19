"""Scaling laws: the compute-optimal split, Approach 3 (Epoch AI's Huber fit) and Approach 2 fits, sweeps."""
import json
import math
import re
import subprocess
import sys

from pathlib import Path

import numpy as np
import pytest
from scipy.optimize import minimize_scalar

from lmkit.scaling import BESIROGLU, CHINCHILLA, ScalingLaw, bootstrap_fit, fit_law, isoflop_fit
from lmkit.errors import ConfigError
from lmkit.scaling.fit import huber_objective
from lmkit.scaling.shapes import DEFAULT_SHAPES, Shape, count_parameters, shape_parameters
from lmkit.scaling.sweep import plan_sweep


def numeric_optimum(law: ScalingLaw, compute: float, k: float = 6.0) -> float:
    """argmin over N of L(N, C / (k N)), found by a bounded search in log N."""
    result = minimize_scalar(lambda x: law.loss(math.exp(x), compute / (k * math.exp(x))), bounds=(0, 80),
                             method="bounded", options={"xatol": 1e-10})
    return math.exp(result.x)


@pytest.mark.parametrize("law", [CHINCHILLA, BESIROGLU, ScalingLaw(E=0.5, A=30.0, B=900.0, alpha=0.7, beta=0.2)])
@pytest.mark.parametrize("compute", [1e12, 3.3e17, 5.76e23])
def test_the_closed_form_optimum_is_the_numeric_minimum_under_the_budget(law, compute):
    n_opt, d_opt = law.compute_optimal(compute)
    assert 6 * n_opt * d_opt == pytest.approx(compute, rel=1e-9)
    assert n_opt == pytest.approx(numeric_optimum(law, compute), rel=1e-5)
    a, b = law.exponents
    assert a + b == pytest.approx(1.0)
    # N_opt grows as C^a
    assert law.compute_optimal(10 * compute)[0] / n_opt == pytest.approx(10 ** a, rel=1e-9)


def test_published_fits_give_their_own_tokens_per_parameter():
    # Epoch AI's refit is consistent with Chinchilla's ~20 tokens per parameter at Chinchilla's budget;
    # Hoffmann et al.'s own Approach-3 constants imply far more data per parameter there
    budget = 5.76e23
    besiroglu = BESIROGLU.tokens_per_parameter(budget)
    assert 17 < besiroglu < 23
    n = numeric_optimum(BESIROGLU, budget)
    assert besiroglu == pytest.approx(budget / (6 * n) / n, rel=1e-4)
    assert CHINCHILLA.tokens_per_parameter(budget) > 2 * besiroglu


def test_the_huber_objective_gradient_matches_finite_differences():
    rng = np.random.default_rng(1)
    log_n, log_d = rng.uniform(15, 22, 12), rng.uniform(17, 25, 12)
    log_l = np.log([CHINCHILLA.loss(math.exp(x), math.exp(y)) for x, y in zip(log_n, log_d)]) + rng.normal(0, 0.01, 12)
    theta = np.array([5.5, 6.2, 0.4, 0.3, 0.25])
    _, grad = huber_objective(theta, log_n, log_d, log_l)
    for i in range(5):
        step = np.zeros(5)
        step[i] = 1e-6
        up, _ = huber_objective(theta + step, log_n, log_d, log_l)
        down, _ = huber_objective(theta - step, log_n, log_d, log_l)
        assert grad[0, i] == pytest.approx((up[0] - down[0]) / 2e-6, rel=1e-4, abs=1e-8)


def chinchilla_points(seed: int, m: int, noise: float):
    rng = np.random.default_rng(seed)
    n = np.exp(rng.uniform(math.log(1e7), math.log(1e11), m))
    d = np.exp(rng.uniform(math.log(1e8), math.log(1e12), m))
    loss = np.array([CHINCHILLA.loss(a, b) for a, b in zip(n, d)]) * np.exp(rng.normal(0, noise, m))
    return n, d, loss


def test_points_from_chinchillas_constants_are_fitted_back_within_their_bootstrap_intervals():
    # percentile intervals cover the truth about 95% of the time, so the draw is fixed
    n, d, loss = chinchilla_points(seed=1, m=60, noise=0.003)
    fit = bootstrap_fit(n, d, loss, samples=30, seed=1)
    for name in ("E", "A", "B", "alpha", "beta"):
        lo, hi = fit.intervals[name]
        assert lo <= getattr(CHINCHILLA, name) <= hi, (name, lo, hi)
        assert lo <= getattr(fit.law, name) <= hi
    lo, hi = fit.intervals["a"]
    assert lo <= CHINCHILLA.exponents[0] <= hi


def test_exact_points_are_fitted_exactly():
    n, d, loss = chinchilla_points(seed=3, m=40, noise=0.0)
    law = fit_law(n, d, loss)
    for name in ("E", "alpha", "beta"):
        assert getattr(law, name) == pytest.approx(getattr(CHINCHILLA, name), rel=2e-3)


def isoflop_points(law: ScalingLaw, budgets, per_budget=7, spread=3.0, noise=0.0, seed=0):
    rng = np.random.default_rng(seed)
    c, n, loss = [], [], []
    for budget in budgets:
        centre = law.compute_optimal(budget)[0]
        for x in np.geomspace(centre / spread, centre * spread, per_budget):
            c.append(budget)
            n.append(x)
            loss.append(law.loss(x, budget / (6 * x)) * math.exp(rng.normal(0, noise)))
    return c, n, loss


def test_approach_2_finds_each_budgets_optimum_and_the_allocation_exponent():
    budgets = [1e18, 1e19, 1e20, 1e21]
    iso = isoflop_fit(*isoflop_points(BESIROGLU, budgets), samples=20)
    for budget, vertex in zip(iso.budgets, iso.n_opt):
        assert vertex == pytest.approx(BESIROGLU.compute_optimal(budget)[0], rel=0.1)  # a parabola in log N
    assert iso.a == pytest.approx(BESIROGLU.exponents[0], abs=0.02)
    assert iso.a + iso.b == pytest.approx(1.0, abs=1e-9)
    assert iso.d_opt_at(1e20) * iso.n_opt_at(1e20) * 6 == pytest.approx(1e20, rel=1e-6)


def test_approach_2_with_noise_has_an_interval_around_the_true_exponent():
    iso = isoflop_fit(*isoflop_points(CHINCHILLA, [1e18, 1e19, 1e20, 1e21], noise=0.002, seed=4), samples=100)
    lo, hi = iso.intervals["a"]
    assert lo < hi
    assert lo - 0.02 <= CHINCHILLA.exponents[0] <= hi + 0.02


def test_too_few_points_or_bad_losses_are_refused():
    from lmkit.errors import ConfigError

    with pytest.raises(ConfigError, match="at least 5 points"):
        fit_law([1e6, 2e6], [1e8, 1e8], [3.0, 2.9])
    with pytest.raises(ConfigError, match="positive"):
        fit_law([1e6] * 6, [1e8] * 6, [3.0, 2.9, -1, 2, 2, 2])
    with pytest.raises(ConfigError, match="two budgets"):
        isoflop_fit([1e12] * 3, [1e5, 2e5, 4e5], [3.0, 2.9, 3.1])


def test_parameter_counts_leave_out_the_embedding_tables():
    import torch

    from lmkit.config import get_preset
    from lmkit.models import build_model

    for preset in ("default", "tiny"):
        config = get_preset(preset)
        model = build_model(config)
        tables = sum(m.weight.numel() for m in model.modules() if isinstance(m, torch.nn.Embedding))
        assert count_parameters(model, "total") == model.num_parameters()
        assert count_parameters(model, "non-embedding") == model.num_parameters() - tables
    shape = Shape.parse("3x96")
    n = shape_parameters(shape, vocab_size=1000, seq_len=64)  # counted on the meta device
    assert n == count_parameters(build_model(get_preset("default", vocab_size=1000, max_seq_len=64,
                                                        **shape.overrides())))


def test_every_default_shape_builds_with_grouped_query_attention():
    from lmkit.config import get_preset

    for shape in DEFAULT_SHAPES:
        o = shape.overrides()
        assert o["n_heads"] % o["n_kv_heads"] == 0 and o["n_kv_heads"] <= max(1, o["n_heads"] // 2)
        get_preset("default", vocab_size=512, max_seq_len=64, **o)  # validates the head split
    assert Shape.parse("3x160").overrides()["n_kv_heads"] == 1  # 5 heads: no divisor between 1 and 2.5 but 1
    assert Shape.parse("8x384").overrides()["n_kv_heads"] == 6


def test_a_sweep_plans_points_that_spend_each_budget():
    plans = plan_sweep([2e12, 6e12], [Shape.parse(s) for s in ("2x64", "2x128", "4x128")], batch_size=8, seq_len=64,
                       vocab_size=512, min_steps=5)
    assert {p.compute for p in plans} == {2e12, 6e12}
    for p in plans:
        assert 6 * p.n_params * p.steps * 8 * 64 == pytest.approx(p.compute, rel=0.05)
    with pytest.raises(Exception, match="LAYERSxWIDTH"):
        Shape.parse("four")


def run_cli(*args, cwd=None):
    return subprocess.run([sys.executable, "-m", "lmkit", "scaling", *args], capture_output=True, text=True, cwd=cwd,
                          timeout=900)


def test_fit_and_plan_from_results_on_disk(tmp_path):
    c, n, loss = isoflop_points(BESIROGLU, [1e15, 1e16, 1e17], per_budget=5, noise=0.001, seed=2)
    rows = [{"run": f"p{i}", "compute": ci, "n_params": ni, "n_tokens": ci / (6 * ni), "val_loss": li,
             "flops_per_token": 6.0, "param_convention": "non-embedding", "seconds": ci / 1e11}
            for i, (ci, ni, li) in enumerate(zip(c, n, loss))]
    (tmp_path / "results.jsonl").write_text("".join(json.dumps(r) + "\n" for r in rows))
    done = run_cli("fit", "--results", str(tmp_path), "--bootstrap", "10")
    assert done.returncode == 0, done.stderr
    fit = json.loads((tmp_path / "fit.json").read_text())
    assert fit["approach_3"]["alpha"] + fit["approach_3"]["beta"] > 0
    assert fit["flops_per_second"] == pytest.approx(1e11, rel=1e-6)
    for picture in ("isoflops.png", "loss_vs_n_d.png"):
        from matplotlib.image import imread

        pixels = imread(tmp_path / picture)
        assert pixels.std() > 0.01  # something is drawn
    planned = run_cli("plan", "--time-budget", "100", "--results", str(tmp_path), "--law", str(tmp_path / "fit.json"))
    assert planned.returncode == 0, planned.stderr
    assert "1e+13 FLOPs" in planned.stdout
    bad = run_cli("plan", "--compute", "1e15", "--law", "nonsense")
    assert bad.returncode == 2 and "chinchilla" in bad.stderr


def test_plan_for_a_time_budget_times_the_shapes_here(tmp_path, small_pydocs):
    """Without --results, `plan --time-budget` sizes as `lmkit train --time-budget` does: at speeds measured here."""
    corpus = tmp_path / "corpus.jsonl"
    small_pydocs(corpus, n=20)
    done = run_cli("plan", "--time-budget", "5", "--corpus", str(corpus), "--batch-size", "4", "--seq-len", "32")
    assert done.returncode == 0, done.stderr
    sized = re.search(r"sized by the pydocs scaling law for 5 s: (\d+)x(\d+)", done.stdout)
    assert sized and int(sized[2]) == 64 * int(sized[1])  # a shape of the preset's ridge
    chosen = float(re.search(r"predicted loss ([\d.]+|inf);", done.stdout)[1])
    others = [float(v) for v in re.findall(r"\d+x\d+ ([\d.]+|inf)[,;]", done.stdout)]
    assert others and all(chosen <= v for v in others)  # the lowest prediction of the shapes measured
    assert f"lmkit train --time-budget 5 --batch-size 4 --seq-len 32  (trains {sized[1]}x{sized[2]})" in done.stdout
    refused = run_cli("plan", "--time-budget", "5", "--corpus", str(corpus), "--law", "nonsense")
    assert refused.returncode == 2 and refused.stderr.count("\n") == 1 and "chinchilla" in refused.stderr


@pytest.mark.slow
def test_a_sweep_trains_its_points_and_a_second_run_continues_without_retraining(tmp_path, small_pydocs):
    corpus = tmp_path / "corpus.jsonl"
    small_pydocs(corpus, n=20)
    # budgets where both shapes get at least one token per parameter (C >= 6 N^2) and a few hundred steps at most
    big = shape_parameters(Shape.parse("1x64"), vocab_size=300, seq_len=64)
    budget = 6 * 1.5 * big ** 2
    args = ("sweep", "--out", str(tmp_path / "sweep"), "--budgets", f"{budget:.4g}", f"{2 * budget:.4g}", "--shapes",
            "1x32", "1x64", "--batch-size", "16", "--seq-len", "64", "--vocab-size", "300", "--min-steps", "3",
            "--corpus", str(corpus))
    first = run_cli(*args)
    assert first.returncode == 0, first.stderr
    rows = [json.loads(line) for line in (tmp_path / "sweep" / "results.jsonl").read_text().splitlines()]
    assert len(rows) == 4 and all(math.isfinite(r["val_loss"]) for r in rows)
    for r in rows:
        metrics = (tmp_path / "sweep" / r["run"] / "metrics.jsonl").read_text().splitlines()
        assert json.loads(metrics[-1])["step"] == r["steps"]
    again = run_cli(*args)
    assert again.returncode == 0
    assert "C=" not in again.stdout  # every point was already in results.jsonl
    assert [json.loads(line) for line in (tmp_path / "sweep" / "results.jsonl").read_text().splitlines()] == rows


def test_kaplan_single_variable_laws_are_fitted_back_on_their_frontier():
    """Points on L(N) = (N_c/N)^a_N, plus points a data limit keeps above it, give a_N and N_c back exactly."""
    from lmkit.scaling.kaplan import fit_power_law, frontier, kaplan_fit

    n = np.geomspace(1e4, 1e7, 7)
    on_law = (8.8e13 / n) ** 0.076
    worse = on_law * 1.05  # the same sizes trained on fewer tokens
    x, losses = np.concatenate([n, n]), np.concatenate([on_law, worse])
    law = fit_power_law(x, losses, "N")
    assert law.points == 7 and law.alpha == pytest.approx(0.076, rel=1e-9) and law.x_c == pytest.approx(8.8e13, rel=1e-6)
    fx, fl = frontier([1, 2, 2, 3, 4], [5.0, 4.0, 3.0, 3.5, 2.0])
    assert fx.tolist() == [1, 2, 4] and fl.tolist() == [5.0, 3.0, 2.0]  # 3 is beaten by the smaller 2
    d = np.geomspace(1e5, 1e8, 6)
    both = kaplan_fit(n[:6], d, (5.4e13 / d) ** 0.095)
    assert both["D"].alpha == pytest.approx(0.095, rel=1e-9) and both["D"].x_c == pytest.approx(5.4e13, rel=1e-6)
    with pytest.raises(ConfigError, match="two points"):
        kaplan_fit(np.full(6, 1e6), d, (5.4e13 / d) ** 0.095)  # one model size: no L(N)
    with pytest.raises(ConfigError, match="two points"):
        fit_power_law(d, d ** 0.1, "D")  # the loss never falls: the frontier is the smallest point alone


def test_scaling_fit_form_kaplan_writes_its_laws(tmp_path):
    rows = [json.loads(line) for line in (Path(__file__).parents[2] / "bench/results/scaling_sweep.jsonl").open()]
    (tmp_path / "results.jsonl").write_text("".join(json.dumps(r) + "\n" for r in rows))
    out = subprocess.run([sys.executable, "-m", "lmkit", "scaling", "fit", "--results", str(tmp_path), "--form",
                          "kaplan"], capture_output=True, text=True)
    assert out.returncode == 0, out.stderr
    fit = json.loads((tmp_path / "kaplan.json").read_text())
    assert 0 < fit["alpha_N"] < 1 and 0 < fit["alpha_D"] < 1 and fit["published"]["alpha_N"] == 0.076
    assert (tmp_path / "kaplan_laws.png").stat().st_size > 10_000 and "alpha_N" in out.stdout
