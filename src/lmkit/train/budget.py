"""How many optimizer steps fit a --time-budget run, from the measured cost of steps and evaluations."""
from __future__ import annotations

EVAL_OVERHEAD = 0.2  # seconds an evaluation costs beyond its forward passes (the save that goes with it)


def planned_steps(step: int, spent: float, budget: float, per_step: float, eval_cost: float,
                  max_steps: int | None) -> tuple[int, int]:
    """(total steps, evaluations): up to ten evaluations, fewer when they would take over a tenth of what is left,
    and the steps that fit the rest of 97% of the budget (a margin for the last save), at least one more."""
    left = 0.97 * budget - spent
    n_evals = max(1, min(10, int(0.1 * left / (eval_cost + EVAL_OVERHEAD))))
    left -= n_evals * (eval_cost + EVAL_OVERHEAD)
    total = max(step + 1, step + int(left / per_step))
    return (min(total, max_steps) if max_steps else total), n_evals


def replanned_steps(step: int, spent: float, planned_at: tuple[int, float], budget: float,
                    max_steps: int | None) -> int | None:
    """The total that ends on 98% of the budget at the speed measured since `planned_at` (step, seconds spent),
    evaluations included; None until four steps have been timed. A machine that got busier (or freer) after the
    first steps still ends on time."""
    step0, spent0 = planned_at
    if step - step0 < 4:
        return None
    per_step = (spent - spent0) / (step - step0)
    total = step + int((0.98 * budget - spent) / per_step)
    return max(step + 1, min(total, max_steps or total))
