"""Parametric scaling laws and their compute-optimal split.

Chinchilla's form (Hoffmann et al. 2022, Approach 3): L(N, D) = E + A / N^alpha + B / D^beta, with N the
parameters and D the training tokens. Under the budget C = k N D (k = 6 FLOPs per parameter per token:
2 forward, 4 backward) the loss is smallest at

    N_opt(C) = G (C / k)^a,   D_opt(C) = (C / k)^b / G,   a = beta / (alpha + beta),   b = alpha / (alpha + beta),
    G = (alpha A / (beta B))^(1 / (alpha + beta)),

found by setting dL/dN = 0 along N D = C / k.
"""
from __future__ import annotations

import json
import math
from dataclasses import asdict, dataclass
from pathlib import Path

from lmkit.errors import ConfigError

FLOPS_PER_TOKEN = 6.0  # per parameter: a forward pass costs 2 N, a backward pass 4 N


@dataclass(frozen=True)
class ScalingLaw:
    """L(N, D) = E + A / N^alpha + B / D^beta."""

    E: float
    A: float
    B: float
    alpha: float
    beta: float

    def loss(self, n_params: float, n_tokens: float) -> float:
        return self.E + self.A / n_params ** self.alpha + self.B / n_tokens ** self.beta

    @property
    def exponents(self) -> tuple[float, float]:
        """(a, b): N_opt grows as C^a and D_opt as C^b; a + b = 1."""
        total = self.alpha + self.beta
        return self.beta / total, self.alpha / total

    def compute_optimal(self, compute: float, flops_per_token: float = FLOPS_PER_TOKEN) -> tuple[float, float]:
        """(N_opt, D_opt) minimising L under flops_per_token * N * D = compute."""
        a, b = self.exponents
        g = (self.alpha * self.A / (self.beta * self.B)) ** (1.0 / (self.alpha + self.beta))
        scaled = compute / flops_per_token
        return g * scaled ** a, scaled ** b / g

    def tokens_per_parameter(self, compute: float, flops_per_token: float = FLOPS_PER_TOKEN) -> float:
        n, d = self.compute_optimal(compute, flops_per_token)
        return d / n

    def to_dict(self) -> dict[str, float]:
        return asdict(self)


# Published fits, for side-by-side tables (tokens are text tokens of each paper's own data and tokenizer).
CHINCHILLA = ScalingLaw(E=1.6934, A=406.4, B=410.7, alpha=0.33917, beta=0.28491)     # Hoffmann et al. 2022, Approach 3
BESIROGLU = ScalingLaw(E=1.8172, A=482.01, B=2085.43, alpha=0.3478, beta=0.3658)     # Epoch AI's replication, 2024
PUBLISHED_LAWS = {"chinchilla": CHINCHILLA, "besiroglu": BESIROGLU}
# Fitted by `lmkit scaling fit` on this project's sweep (bench/results/scaling_sweep.jsonl, docs/scaling.md): the
# default preset's recipe on pydocs, vocabulary 4096, 16 x 128-token batches, 15 points of 25k to 545k parameters
# trained on 3e11 to 3e12 FLOPs; nats per token on pydocs' validation split. It sizes --time-budget runs.
PYDOCS = ScalingLaw(E=2.5407, A=9.7621, B=2109.27, alpha=0.15764, beta=0.55746)
NAMED_LAWS = {**PUBLISHED_LAWS, "pydocs": PYDOCS}

# Published allocation exponents (N_opt ~ C^a, D_opt ~ C^b) and Kaplan et al. 2020's single-variable exponents.
PUBLISHED_EXPONENTS = {
    "kaplan-2020": {"a": 0.73, "b": 0.27, "alpha_N": 0.076, "alpha_D": 0.095},
    "chinchilla-approach-1": {"a": 0.50, "b": 0.50},
    "chinchilla-approach-2": {"a": 0.49, "b": 0.51},
    "chinchilla-approach-3": dict(zip("ab", CHINCHILLA.exponents)),
    "besiroglu-2024": dict(zip("ab", BESIROGLU.exponents)),
}


def law_from(name_or_dict) -> ScalingLaw:
    """A published law by name, or a fit's dict with E, A, B, alpha, beta."""

    if isinstance(name_or_dict, dict):
        try:
            return ScalingLaw(**{k: float(name_or_dict[k]) for k in ("E", "A", "B", "alpha", "beta")})
        except KeyError as exc:
            raise ConfigError(f"a scaling law needs E, A, B, alpha and beta; {exc.args[0]} is missing") from None
    if name_or_dict not in NAMED_LAWS:
        raise ConfigError(f"unknown scaling law {name_or_dict!r}; choose {', '.join(NAMED_LAWS)} or a fit.json "
                          "written by `lmkit scaling fit`")
    return NAMED_LAWS[name_or_dict]


def load_law(spec: str) -> ScalingLaw:
    """A law by name (chinchilla, besiroglu, pydocs) or from the fit.json that `lmkit scaling fit` writes."""
    if spec in NAMED_LAWS:
        return NAMED_LAWS[spec]
    path = Path(spec)
    if not path.is_file():
        raise ConfigError(f"scaling law {spec!r} is neither {', '.join(NAMED_LAWS)} nor a fit.json file")
    try:
        data = json.loads(path.read_text(encoding="utf-8"))
    except (json.JSONDecodeError, UnicodeDecodeError):
        raise ConfigError(f"{path} is not JSON; give a fit.json written by `lmkit scaling fit`") from None
    if not isinstance(data, dict):
        raise ConfigError(f"{path} holds no scaling law; give a fit.json written by `lmkit scaling fit`")
    return law_from(data.get("approach_3", data))


def isoflop_tokens(compute: float, n_params: float, flops_per_token: float = FLOPS_PER_TOKEN) -> float:
    """D = C / (k N): the tokens a model of n_params trains on within the budget."""
    if compute <= 0 or n_params <= 0:
        raise ValueError("compute and n_params must be positive")
    return compute / (flops_per_token * n_params)
