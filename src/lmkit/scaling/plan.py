"""The compute-optimal model for a budget: N and D from a law, and a shape of the `default` preset whose N is
nearest to N_opt (in log)."""
from __future__ import annotations

import math
from dataclasses import dataclass

from lmkit.scaling.laws import FLOPS_PER_TOKEN, ScalingLaw
from lmkit.scaling.shapes import HEAD_DIM, Shape, shape_parameters

CANDIDATE_LAYERS = (2, 3, 4, 6, 8, 10, 12, 16, 20, 24, 32)


def candidate_shapes(max_width: int = 4096) -> list[Shape]:
    """Depths and widths (multiples of 64) with 32 to 128 width per layer, the aspect ratios of GPT-2- and
    LLaMA-like models at small scale."""
    return [Shape(layers, width) for layers in CANDIDATE_LAYERS for width in range(2 * HEAD_DIM, max_width + 1, 64)
            if 32 <= width / layers <= 128]


@dataclass
class ComputePlan:
    compute: float
    n_params: float
    n_tokens: float
    shape: Shape
    shape_params: int
    steps: int
    loss: float

    @property
    def tokens_per_parameter(self) -> float:
        return self.n_tokens / self.n_params


def plan_compute(law: ScalingLaw, compute: float, vocab_size: int, seq_len: int, batch_size: int,
                 flops_per_token: float = FLOPS_PER_TOKEN, convention: str = "non-embedding") -> ComputePlan:
    """N_opt and D_opt under compute = k N D, the candidate shape nearest N_opt, and the steps that spend the
    budget on that shape."""
    n_opt, d_opt = law.compute_optimal(compute, flops_per_token)
    sized = [(shape, shape_parameters(shape, vocab_size, seq_len, convention)) for shape in candidate_shapes()]
    shape, n_shape = min(sized, key=lambda item: abs(math.log(item[1] / n_opt)))
    steps = max(1, round(compute / (flops_per_token * n_shape) / (batch_size * seq_len)))
    return ComputePlan(compute, n_opt, d_opt, shape, n_shape, steps, law.loss(n_opt, d_opt))
