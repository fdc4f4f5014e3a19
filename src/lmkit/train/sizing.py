"""A --time-budget run's model, sized from a scaling law and this machine's measured training speed.

A shape that trains r tokens per second sees D = r S tokens in a budget of S seconds, so the law predicts
L(N, r S) = E + A / N^alpha + B / (r S)^beta for it (N: non-embedding parameters, as the law was fitted). r is
measured, not derived from 6N FLOPs per token: a few real optimizer steps of the run's own recipe (rows, batch,
context, precision, optimizer, threads) per shape, so the embedding and output layers, which N leaves out but
which dominate the time of small shapes, are paid for. The candidates lie on the default preset's ridge (64 of
width per layer, as its 256 over 4 and GPT-2 small's 768 over 12; 32 per head and grouped key/value heads, as
`lmkit scaling sweep` shapes them). The walk starts at the preset, goes to the neighbour with the lower
prediction and on while the prediction falls, and never to a shape too slow for MIN_STEPS steps in the budget.
"""
from __future__ import annotations

import dataclasses
import math
import time
from dataclasses import dataclass
from typing import Callable


from lmkit.config import get_preset
from lmkit.errors import ConfigError
from lmkit.scaling.laws import ScalingLaw, load_law
from lmkit.scaling.shapes import Shape, count_parameters
from lmkit.train.config import TrainConfig
from lmkit.train.setup import TrainingSetup, init_model, run_model_config

SIZED_PRESET = "default"  # the preset whose shape a time budget sizes (the law was fitted on its recipe)
DEFAULT_LAW = "pydocs"    # lmkit.scaling.laws.PYDOCS: fitted on the default recipe's sweep (docs/scaling.md)
WIDTH_PER_LAYER = 64
TIMED_STEPS = 3           # the fastest counts; after one untimed step (first allocations, the optimizer state)
MIN_STEPS = 100           # fewer steps than this in the budget and the schedule is mostly warm-up
MAX_LAYERS = 24


@dataclass(frozen=True)
class Candidate:
    shape: Shape
    n_params: int               # non-embedding, the law's N
    tokens_per_second: float    # measured
    predicted_loss: float       # the law's L(N, tokens_per_second * budget), nats per token


@dataclass(frozen=True)
class Sizing:
    law: str
    budget: float
    chosen: Candidate
    measured: tuple[Candidate, ...]  # in the order measured
    seconds: float                   # spent measuring

    def describe(self) -> str:
        c = self.chosen
        others = ", ".join(f"{m.shape.name} {m.predicted_loss:.3f}" for m in sorted(self.measured, key=lambda m: m.n_params)
                           if m is not c)
        return (f"sized by the {self.law} scaling law for {self.budget:g} s: {c.shape.name} (N = {c.n_params:,}, "
                f"{c.tokens_per_second:,.0f} tokens/s measured, predicted loss {c.predicted_loss:.3f}; "
                f"{others}; {self.seconds:.1f} s spent measuring)")


def applies(cfg: TrainConfig, world_size: int) -> bool:
    """Whether this run's model is sized: a new one-process causal-LM run of the default preset with a time budget,
    its shape not given, sizing not turned off. Under torchrun the ranks would each measure and could disagree.
    A law named for a new run that cannot be sized is refused; a run that resumes keeps the shape it has."""
    if cfg.sizing == "off" or cfg.resume:
        return False
    sizable = (cfg.time_budget is not None and world_size == 1 and cfg.preset == SIZED_PRESET
               and not cfg.model_overrides and cfg.objective == "clm")
    if cfg.sizing != "auto":
        load_law(cfg.sizing)  # an unknown law is an error whether or not it is used
        if not sizable:
            raise ConfigError(f"--sizing {cfg.sizing}: only a one-process --time-budget run of the default preset "
                              "(clm, no model overrides) is sized; drop --sizing or give --time-budget")
    return sizable


def ridge_shape(n_layers: int) -> Shape:
    return Shape(n_layers, WIDTH_PER_LAYER * n_layers)


def with_shape(setup: TrainingSetup, shape: Shape) -> TrainingSetup:
    """The run's set-up with the model replaced by `shape` of the preset, initialised as the run would be."""
    overrides = shape.overrides()
    cfg = dataclasses.replace(setup.cfg, model_overrides=overrides)
    config = run_model_config(get_preset(cfg.preset, **overrides), cfg, setup.objective, setup.data)
    model = init_model(config, cfg.seed, next(setup.model.parameters()).device)
    return dataclasses.replace(setup, cfg=cfg, model_config=config, model=model)


def tokens_per_second(trainer) -> float:
    """Training tokens per second of `trainer`'s own step, the fastest of TIMED_STEPS after one untimed step."""
    trainer.train_step(0)
    fastest = float("inf")
    for step in range(1, TIMED_STEPS + 1):
        start = time.perf_counter()
        trainer.train_step(step)
        fastest = min(fastest, time.perf_counter() - start)
    return trainer.cfg.batch_size * trainer.cfg.seq_len / fastest


def measure(setup: TrainingSetup, shape: Shape, make_trainer: Callable[[TrainingSetup], object]) -> tuple[int, float]:
    """(N, training tokens per second) of `shape` in the run's recipe, timed through `make_trainer`'s steps."""
    candidate = with_shape(setup, shape)
    return count_parameters(candidate.model), tokens_per_second(make_trainer(candidate))


def choose(law: ScalingLaw, budget: float, tokens_per_step: int, start_layers: int,
           measure: Callable[[Shape], tuple[int, float]], max_layers: int = MAX_LAYERS) -> tuple[Candidate, list[Candidate]]:
    """The ridge's shape with the lowest predicted loss, walking downhill from `start_layers` (towards fewer layers
    first); `measure(shape)` gives (N, tokens per second). A shape too slow for MIN_STEPS steps in the budget
    predicts an infinite loss, and among such shapes the faster is better, so a budget too short for the preset
    walks down to a shape that fits. Returns the best candidate and every one measured, in order."""
    seen: dict[int, Candidate] = {}

    def key(layers: int) -> tuple[float, float]:
        if not 1 <= layers <= max_layers:
            return (math.inf, math.inf)
        if layers not in seen:
            shape = ridge_shape(layers)
            n, rate = measure(shape)
            tokens = rate * budget
            seen[layers] = Candidate(shape, n, rate, law.loss(n, tokens) if tokens >= MIN_STEPS * tokens_per_step
                                     else math.inf)
        return (seen[layers].predicted_loss, 1.0 / seen[layers].tokens_per_second)

    layers = start_layers
    direction = -1 if key(layers - 1) < key(layers) else 1
    while key(layers + direction) < key(layers):
        layers += direction
    return seen[layers], list(seen.values())


def size_model(setup: TrainingSetup, make_trainer: Callable[[TrainingSetup], object]) -> tuple[TrainingSetup, Sizing]:
    """The set-up with the model of the ridge shape that the law (cfg.sizing, or the pydocs law for "auto")
    predicts best for cfg.time_budget; `make_trainer(setup)` gives a trainer whose steps are timed."""
    cfg = setup.cfg
    name = DEFAULT_LAW if cfg.sizing == "auto" else cfg.sizing
    law = load_law(name)
    start = time.perf_counter()
    chosen, measured = choose(law, cfg.time_budget, cfg.batch_size * cfg.seq_len, get_preset(cfg.preset).n_layers,
                              lambda shape: measure(setup, shape, make_trainer))
    sized = with_shape(setup, chosen.shape)  # built afresh: the measured copy has taken optimizer steps
    return sized, Sizing(name, cfg.time_budget, chosen, tuple(measured), time.perf_counter() - start)
