"""When a training run evaluates and saves.

--eval-every / --save-every put evaluations and saves at multiples of N. Without them a run evaluates
and saves about `n_evals` times: `every` steps after the last one, where `every` divides the planned
steps (a --time-budget run's plan, re-fitted as it goes) by `n_evals`. Counting from the last one keeps
them apart when a replan changes `every`: multiples of the new value could fall right after one.
"""
from __future__ import annotations

from dataclasses import dataclass


@dataclass
class EvalSaveSchedule:
    """The steps at which the loop evaluates and saves; `evaluated` / `saved` record what it did."""

    eval_every: int | None   # --eval-every (None: --save-every, else spaced by the plan)
    save_every: int | None   # --save-every (None: spaced by the plan)
    log_every: int           # evaluations of a fixed run fall on logged steps
    last_eval: int = 0
    last_save: int = 0

    def every(self, total_steps: int | None, planned_at: tuple[int, float] | None, n_evals: int) -> int:
        """Steps between evaluations and saves spaced by the plan; 0 while a time budget has no plan yet."""
        if planned_at is not None:
            return max(1, (total_steps - planned_at[0]) // n_evals)
        return self.fixed_interval(total_steps) if total_steps else 0

    def fixed_interval(self, total: int) -> int:
        """Evaluations of a fixed run: about ten, at multiples of --log-every once the run logs at all,
        so that evaluation rows keep metrics.jsonl's spacing (a shorter run still evaluates ten times)."""
        every, log = max(1, total // 10), self.log_every
        return -(-every // log) * log if total >= log else every

    def eval_due(self, step: int, every: int) -> bool:
        fixed = self.eval_every or self.save_every
        return step % fixed == 0 if fixed else bool(every) and step - self.last_eval >= every

    def save_due(self, step: int, every: int) -> bool:
        return step % self.save_every == 0 if self.save_every else bool(every) and step - self.last_save >= every

    def evaluated(self, step: int) -> None:
        self.last_eval = step

    def saved(self, step: int) -> None:
        self.last_save = step
