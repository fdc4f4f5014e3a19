"""`lmkit scaling sweep | fit | plan`: IsoFLOP sweeps on this machine, Chinchilla-style fits, compute-optimal plans.

C = k N D with k = 6 FLOPs per parameter per token (--flops-per-token) and N the non-embedding parameters
(--params total counts the embedding tables too).
"""
from __future__ import annotations

import argparse
import json
from pathlib import Path

from lmkit.atomic import atomic_write_json
from lmkit.cli.helptext import add_command
from lmkit.errors import ConfigError

DEFAULT_BUDGETS = (3e11, 1e12, 3e12)


def register(subparsers) -> None:
    p = add_command(subparsers, "scaling", help="scaling laws: sweep, fit, plan", description=__doc__, example_lines=(
        "lmkit scaling sweep --out sweep/ --budgets 1e11 3e11",
        "lmkit scaling fit --results sweep/",
        "lmkit scaling plan --compute 1e15"))
    sub = p.add_subparsers(dest="scaling_command", metavar="sweep|fit|plan", required=True)

    s = add_command(sub, "sweep", help="train an IsoFLOP grid of run folders; results.jsonl collects the points",
                    description="Train every model shape at every compute budget C (steps chosen so that C = k N D) "
                                "into run folders under --out; results.jsonl collects each point's N, D, C and "
                                "validation loss. A point already in results.jsonl is not trained again.",
                    example_lines=("lmkit scaling sweep --out sweep/                     # about an hour on 2 cores",
                                   "lmkit scaling sweep --out quick/ --budgets 1e11 3e11 --shapes 2x32 2x64 3x64"))
    s.add_argument("--out", required=True, metavar="DIR", help="sweep folder (run folders and results.jsonl)")
    s.add_argument("--budgets", nargs="+", type=float, metavar="C", default=list(DEFAULT_BUDGETS),
                   help="compute budgets in FLOPs (default: 3e11 1e12 3e12, about an hour on 2 cores)")
    s.add_argument("--shapes", nargs="+", metavar="LxD",
                   help="model shapes as LAYERSxWIDTH of the default preset (default: 2x32 ... 3x128)")
    s.add_argument("--corpus", nargs="+", default=["pydocs"], metavar="NAME|PATH",
                   help="built-in corpus (pydocs, pycode) or text files, folders, globs, .jsonl")
    s.add_argument("--batch-size", type=int, default=16, metavar="N", help="sequences per step of every run")
    s.add_argument("--seq-len", type=int, default=128, metavar="N", help="tokens per sequence")
    s.add_argument("--vocab-size", type=int, default=4096, metavar="N", help="ids of the BPE tokenizer trained once for all runs")
    s.add_argument("--optimizer", choices=["adamw", "muon"], help="default: the default preset's")
    s.add_argument("--lr", type=float, metavar="X", help="peak learning rate (default: the default preset's recipe)")
    s.add_argument("--seed", type=int, default=0, metavar="N", help="random seed of every run")
    s.add_argument("--min-steps", type=int, default=20, metavar="N", help="skip points shorter than N steps")
    s.add_argument("--max-tokens-per-param", type=float, default=100.0, metavar="X",
                   help="skip points with more training tokens per parameter (default 100)")
    _convention(s)
    s.set_defaults(func=run_sweep)

    f = add_command(sub, "fit", help="fit Approach 3 (Huber, L-BFGS, bootstrap) and Approach 2 to a sweep",
                    description="Fit L(N, D) = E + A / N^alpha + B / D^beta to a sweep (Chinchilla's Approach 3: Huber "
                                "loss on log L, L-BFGS, bootstrap intervals) and the IsoFLOP minima (Approach 2); "
                                "write fit.json and the plots.",
                    example_lines=("lmkit scaling fit --results sweep/",
                                   "lmkit scaling fit --results sweep/results.jsonl --out fit/ --bootstrap 50"))
    f.add_argument("--results", required=True, metavar="PATH", help="a sweep folder or its results.jsonl")
    f.add_argument("--out", metavar="DIR", help="where fit.json and the plots go (default: beside the results)")
    f.add_argument("--bootstrap", type=int, default=200, metavar="N", help="bootstrap resamples (default 200)")
    f.add_argument("--seed", type=int, default=0, metavar="N", help="seed of the bootstrap resampling")
    f.add_argument("--form", choices=["chinchilla", "kaplan"], default="chinchilla",
                   help="chinchilla: L(N, D) = E + A/N^alpha + B/D^beta (Approaches 3 and 2); kaplan: the single-"
                        "variable laws L(N) = (N_c/N)^alpha_N and L(D) = (D_c/D)^alpha_D on the sweep's frontier, "
                        "written to kaplan.json and kaplan_laws.png (default chinchilla)")
    f.set_defaults(func=run_fit)

    q = add_command(sub, "plan", help="the compute-optimal N, D and a shape for a budget",
                    description="The compute-optimal parameters N and tokens D for a budget under a scaling law, and "
                                "a shape of the default preset near that N.",
                    example_lines=("lmkit scaling plan --compute 1e15",
                                   "lmkit scaling plan --time-budget 600 --law pydocs",
                                   "lmkit scaling plan --compute 3e14 --law sweep/fit.json"))
    budget = q.add_mutually_exclusive_group(required=True)
    budget.add_argument("--compute", type=float, metavar="C", help="budget in FLOPs (this or --time-budget)")
    budget.add_argument("--time-budget", type=float, metavar="SECONDS",
                        help="budget in seconds on this machine, at the throughput measured by a sweep (--results)")
    q.add_argument("--law", metavar="NAME|FIT.json",
                   help="chinchilla, besiroglu, pydocs (this project's sweep) or a fit.json written by `lmkit scaling "
                        "fit`; default besiroglu, and pydocs for --time-budget without --results")
    q.add_argument("--results", metavar="PATH",
                   help="a sweep folder: its median FLOP/s for --time-budget; without it (the default), --time-budget "
                        "times the candidate shapes here, as `lmkit train --time-budget` does")
    q.add_argument("--corpus", nargs="+", default=["pydocs"], metavar="NAME|PATH",
                   help="the text the measuring steps read (--time-budget without --results; default pydocs)")
    q.add_argument("--batch-size", type=int, metavar="N",
                   help="default 16 (the sweep's), or the default recipe's 24 when timing shapes here")
    q.add_argument("--seq-len", type=int, default=128, metavar="N", help="tokens per sequence of the planned run")
    q.add_argument("--vocab-size", type=int, default=4096, metavar="N", help="vocabulary of the planned model")
    _convention(q)
    q.set_defaults(func=run_plan)


def _convention(p) -> None:
    p.add_argument("--flops-per-token", type=float, default=6.0, metavar="K", help="C = K N D (default 6)")
    p.add_argument("--params", choices=["non-embedding", "total"], default="non-embedding",
                   help="what N counts (default: non-embedding, as Kaplan et al.)")


def run_sweep(args: argparse.Namespace) -> int:
    from lmkit.scaling.shapes import DEFAULT_SHAPES, Shape
    from lmkit.scaling.sweep import plan_sweep
    from lmkit.train.sweep import run_sweep as sweep

    shapes = [Shape.parse(s) for s in args.shapes] if args.shapes else list(DEFAULT_SHAPES)
    plans = plan_sweep(args.budgets, shapes, args.batch_size, args.seq_len, args.vocab_size, args.flops_per_token,
                       args.params, min_steps=args.min_steps,
                       max_tokens_per_param=args.max_tokens_per_param)
    print(f"lmkit scaling sweep: {len(plans)} points over {len(set(p.compute for p in plans))} budgets into {args.out}")
    rows = sweep(args.out, plans, args.corpus, args.batch_size, args.seq_len, args.vocab_size, args.flops_per_token,
                 args.params, optimizer=args.optimizer, lr=args.lr, seed=args.seed)
    print(f"{len(rows)} points in {Path(args.out) / 'results.jsonl'}; next: lmkit scaling fit --results {args.out}")
    return 0


def run_fit(args: argparse.Namespace) -> int:
    from lmkit.scaling.fit import bootstrap_fit, isoflop_fit
    from lmkit.scaling.laws import PUBLISHED_EXPONENTS
    from lmkit.scaling.plots import plot_isoflops, plot_loss_vs
    from lmkit.scaling.sweep import read_results

    rows = read_results(args.results)
    results = Path(args.results)
    out = Path(args.out) if args.out else (results if results.is_dir() else results.parent)
    out.mkdir(parents=True, exist_ok=True)
    n, d, l, c = ([r[k] for r in rows] for k in ("n_params", "n_tokens", "val_loss", "compute"))
    if args.form == "kaplan":
        return _fit_kaplan(rows, n, d, l, out)
    law_fit = bootstrap_fit(n, d, l, samples=args.bootstrap, seed=args.seed, progress=True)
    try:
        iso = isoflop_fit(c, n, l, rows[0]["flops_per_token"], samples=args.bootstrap, seed=args.seed)
    except ConfigError as exc:
        iso = None
        print(f"Approach 2 skipped: {exc}")
    law, ci = law_fit.law, law_fit.intervals
    print(f"Approach 3 on {len(rows)} points (Huber delta 1e-3 on log L, {args.bootstrap} bootstrap resamples, "
          f"{law_fit.level:.0%} intervals):")
    for name in ("E", "A", "B", "alpha", "beta"):
        lo, hi = ci.get(name, (float("nan"),) * 2)
        print(f"  {name:>5} = {getattr(law, name):10.4g}   [{lo:.4g}, {hi:.4g}]")
    a, b = law.exponents
    print("allocation exponents N_opt ~ C^a, D_opt ~ C^b:")
    print(f"  {'this fit (Approach 3)':<26} a = {a:.3f} [{ci['a'][0]:.3f}, {ci['a'][1]:.3f}]  b = {b:.3f}"
          if "a" in ci else f"  this fit (Approach 3)      a = {a:.3f}  b = {b:.3f}")
    if iso is not None:
        ia = iso.intervals.get("a", (float("nan"),) * 2)
        print(f"  {'this fit (Approach 2)':<26} a = {iso.a:.3f} [{ia[0]:.3f}, {ia[1]:.3f}]  b = {iso.b:.3f}")
    for name, e in PUBLISHED_EXPONENTS.items():
        print(f"  {name:<26} a = {e['a']:.3f}  b = {e['b']:.3f}")
    for budget in sorted(set(c)):
        print(f"  C = {budget:.3g}: tokens per parameter {law.tokens_per_parameter(budget, rows[0]['flops_per_token']):.1f}")
    fit = {"approach_3": law_fit.to_dict(), "approach_2": iso.to_dict() if iso else None,
           "flops_per_token": rows[0]["flops_per_token"], "param_convention": rows[0].get("param_convention"),
           "flops_per_second": _throughput(rows)}
    atomic_write_json(out / "fit.json", fit)
    plot_isoflops(rows, out / "isoflops.png", iso, law)
    plot_loss_vs(rows, out / "loss_vs_n_d.png", law)
    print(f"wrote {out / 'fit.json'}, {out / 'isoflops.png'}, {out / 'loss_vs_n_d.png'}")
    return 0


def _fit_kaplan(rows, n, d, l, out: Path) -> int:
    from lmkit.scaling.kaplan import KAPLAN_PUBLISHED, kaplan_fit
    from lmkit.scaling.plots import plot_kaplan

    laws = kaplan_fit(n, d, l)
    print(f"Kaplan et al. 2020's single-variable laws on {len(rows)} points (least squares in log-log on each "
          "frontier):")
    for var in ("N", "D"):
        law = laws[var]
        print(f"  L({var}) = ({var}_c / {var})^alpha_{var}: alpha_{var} = {law.alpha:.3f}, {var}_c = {law.x_c:.3g} "
              f"({law.points} frontier points); published alpha_{var} = {KAPLAN_PUBLISHED['alpha_' + var]}, "
              f"{var}_c = {KAPLAN_PUBLISHED[var + '_c']:.2g}")
    atomic_write_json(out / "kaplan.json", {
        "alpha_N": laws["N"].alpha, "N_c": laws["N"].x_c, "frontier_points_N": laws["N"].points,
        "alpha_D": laws["D"].alpha, "D_c": laws["D"].x_c, "frontier_points_D": laws["D"].points,
        "published": KAPLAN_PUBLISHED, "param_convention": rows[0].get("param_convention")})
    plot_kaplan(rows, laws, out / "kaplan_laws.png")
    print(f"wrote {out / 'kaplan.json'}, {out / 'kaplan_laws.png'}")
    return 0


def _throughput(rows):
    from lmkit.scaling.sweep import measured_flops_per_second

    try:
        return measured_flops_per_second(rows)
    except ConfigError:
        return None


def plan_measured(args: argparse.Namespace) -> int:
    """--time-budget without --results: the shape `lmkit train --time-budget` would train, at the speeds measured
    here in the default recipe (train/sizing.py)."""
    import tempfile

    from lmkit.train import TrainConfig
    from lmkit.train.setup import prepare_training
    from lmkit.train.sizing import size_model
    from lmkit.train.trainer import Trainer

    with tempfile.TemporaryDirectory() as scratch:  # prepare_training writes nothing; --out must still be a path
        setup = prepare_training(TrainConfig(out=f"{scratch}/run", time_budget=args.time_budget, sizing=args.law,
                                             batch_size=args.batch_size, seq_len=args.seq_len,
                                             vocab_size=args.vocab_size, corpus=args.corpus, progress=False))
        _, sizing = size_model(setup, lambda candidate: Trainer(candidate.cfg, setup=candidate))
    print(sizing.describe())
    batch = "" if args.batch_size is None else f" --batch-size {args.batch_size}"
    print(f"lmkit train --time-budget {args.time_budget:g}{batch} --seq-len {args.seq_len}"
          + ("" if args.law == "pydocs" else f" --sizing {args.law}") + f"  (trains {sizing.chosen.shape.name})")
    return 0


def run_plan(args: argparse.Namespace) -> int:
    from lmkit.scaling.laws import load_law
    from lmkit.scaling.plan import plan_compute
    from lmkit.scaling.sweep import measured_flops_per_second, read_results

    if args.law is None:
        args.law = "pydocs" if args.time_budget is not None and not args.results else "besiroglu"
    if args.time_budget is not None and not args.results:
        return plan_measured(args)
    args.batch_size = args.batch_size or 16
    law = load_law(args.law)
    compute = args.compute
    if args.time_budget is not None:
        rate = measured_flops_per_second(read_results(args.results))
        compute = rate * args.time_budget
        print(f"{args.time_budget:g} s at {rate:.3g} FLOP/s (median of the sweep's runs) = {compute:.3g} FLOPs")
    if not compute or compute <= 0:
        raise ConfigError("the budget must be positive")
    plan = plan_compute(law, compute, args.vocab_size, args.seq_len, args.batch_size, args.flops_per_token, args.params)
    print(f"compute {plan.compute:.3g} FLOPs: N_opt {plan.n_params:,.0f}, D_opt {plan.n_tokens:,.0f} tokens "
          f"({plan.tokens_per_parameter:.1f} tokens per parameter), predicted loss {plan.loss:.3f}")
    print(f"shape {plan.shape.name} (N = {plan.shape_params:,}): lmkit train --max-steps {plan.steps} --batch-size "
          f"{args.batch_size} --seq-len {args.seq_len}  (model_overrides {json.dumps(plan.shape.overrides())})")
    return 0
