"""The one training loop: every job that updates weights (pre-training, SFT, causal-LM fine-tuning with or without
PEFT, classification, distillation, seq2seq pairs) runs its optimizer steps here.

    loss of step s = sum over the step's micro-batches b and ranks r of loss_sum(b) / sum of count(b)

a count-weighted mean, so accumulating k micro-batches (or k ranks) gives the gradient of one batch k times larger.
A job (`Job`) supplies what differs: the model and its optimizer, the micro-batches of step s, an objective
(`count`, `loss`), its evaluation and its outputs. The loop owns the rest: precision (bf16 autocast), accumulation,
clipping, the learning-rate schedule, NaN checks, the time budget, the evaluation and save schedule,
metrics.jsonl as it goes, the progress bar, torchrun (DDP / FSDP) and exact resume (model, optimizer, RNG states
and the job's own state in a checkpoint; every other random choice is a function of (seed, step, rank)).
"""
from __future__ import annotations

import math
import shutil
import sys
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch

from lmkit.device import to_device
from lmkit.errors import TrainingError
from lmkit.evaluate.perplexity import autocast
from lmkit.objectives import with_aux_loss
from lmkit.progress import progress_bar
from lmkit.train import distributed as D
from lmkit.train.budget import planned_steps, replanned_steps
from lmkit.train.checkpoint import (checkpoints, latest_checkpoint, load_checkpoint, read_checkpoint, rng_state,
                                    save_checkpoint, set_rng_state)
from lmkit.train.job import Job
from lmkit.train.metrics import MetricsLog
from lmkit.train.optim import learning_rate, set_lr
from lmkit.train.schedule import EvalSaveSchedule
from lmkit.train.seeds import resume_seed

CALIBRATION_STEPS = 8  # steps timed before a --time-budget run fixes its step count


@dataclass
class LoopSettings:
    """How the loop runs a job; the flags of the same names (`lmkit train`, `lmkit finetune`)."""

    lr: float
    max_steps: int | None = None        # None with time_budget: planned from the measured speed
    time_budget: float | None = None    # seconds of training
    min_lr: float = 0.0
    lr_schedule: str = "cosine"         # linear | cosine | constant, after a linear warm-up
    grad_clip: float | None = 1.0
    precision: str = "fp32"             # fp32 | bf16 (autocast)
    log_every: int = 10
    eval_every: int | None = None
    save_every: int | None = None
    keep_checkpoints: int = 3
    spaced: bool = False                # without --eval-every / --save-every: about ten evaluations and saves
    resume: bool = False
    progress: bool = False
    fsdp: bool = False


class TrainLoop:
    """Runs `job` under `settings` on the processes of `ctx`; `fit()` returns the last step's summary."""

    def __init__(self, job: Job, settings: LoopSettings, out: str | Path | None, ctx: D.DistContext | None = None):
        """`out` None: nothing is written (no metrics.jsonl, no checkpoints; the job keeps what it needs)."""
        self.job, self.s, self.out = job, settings, None if out is None else Path(out)
        job.loop = self
        self.ctx = ctx or D.DistContext()
        self.rank, self.world_size, self.device = self.ctx.rank, self.ctx.world_size, self.ctx.device
        self.model = job.model
        if self.device.type != "cpu":
            self.model.to(self.device)
        self.engine = D.wrap_model(self.model, self.ctx, settings.fsdp)  # what the step calls: DDP / FSDP / the model
        self.loss_scale = D.loss_scale(self.ctx, settings.fsdp)
        self.optimizer = job.build_optimizer()  # after FSDP sharded the parameters it holds
        self.step, self.tokens_seen, self.elapsed = 0, 0, 0.0
        self.total_steps = settings.max_steps if settings.time_budget is None else None
        self.metrics = None if self.out is None else MetricsLog(self.out / "metrics.jsonl")
        self.planned_at: tuple[int, float] | None = None
        self.n_evals = 10
        self._eval_at_plan = None
        self.last_row: dict[str, Any] = {}
        self.grad_norm: float | None = None
        self.step_count, self.last_loss = 0, None  # the last step's targets (over all ranks) and mean loss

    # one optimizer step ---------------------------------------------------------------------------------
    def lr_at(self, step: int) -> float:
        total = self.total_steps or 10**9  # before a time budget is planned only the warm-up applies
        return learning_rate(self.s.lr_schedule, step, self.s.lr, self.job.warmup(self.total_steps), total,
                             self.s.min_lr)

    def train_step(self, step: int) -> float:
        """Optimizer step `step`; returns its mean training loss (over all ranks)."""
        set_lr(self.optimizer, self.lr_at(step))
        micro_batches = [to_device(b, self.device) for b in self.job.micro_batches(step, self.rank, self.world_size)]
        objective = self.job.objective
        count = D.all_reduce_sum(torch.tensor(float(sum(objective.count(b) for b in micro_batches))),
                                 self.ctx).item()
        coef = getattr(getattr(self.model, "config", None), "router_aux_loss_coef", 0.0)
        share = len(micro_batches) * self.world_size
        nats = torch.zeros((), dtype=torch.float64)
        for i, part in enumerate(micro_batches):
            with D.no_sync(self.engine, skip=i < len(micro_batches) - 1):  # all-reduce once, after the last
                with autocast(self.device, self.s.precision):
                    loss_sum, aux = objective.loss(self.engine, part)
                # gradients are summed over micro-batches and ranks: each adds its share of the aux loss
                loss = with_aux_loss(loss_sum.sum / max(count, 1), aux, coef, share)
                (loss * self.loss_scale if self.loss_scale != 1.0 else loss).backward()
            nats += loss_sum.sum.detach().double().cpu()
        mean = D.all_reduce_sum(nats, self.ctx).item() / max(count, 1)
        if not math.isfinite(mean):
            self.optimizer.zero_grad(set_to_none=True)
            raise TrainingError(f"the training loss became {mean} at step {step + 1}; " + self.divergence_hint())
        self.grad_norm = None
        if self.s.grad_clip:
            self.grad_norm = float(torch.nn.utils.clip_grad_norm_(self.model.parameters(), self.s.grad_clip))
        self.optimizer.step()
        self.optimizer.zero_grad(set_to_none=True)
        self.tokens_seen += int(count)
        self.step_count, self.last_loss = int(count), mean
        return mean

    def divergence_hint(self) -> str:
        return f"lower --lr (now {self.s.lr})" + (", or use --precision fp32" if self.s.precision == "bf16" else "")

    # checkpoints -------------------------------------------------------------------------------------------
    def resume(self, path: Path | None = None) -> dict[str, Any]:
        """Model, optimizer and RNG states of every rank, the step and the job's state from the latest checkpoint."""
        path = path or latest_checkpoint(self.out)
        if path is None:
            raise TrainingError(f"--resume: {self.out} holds no checkpoint to continue from; run without --resume "
                                "(and with --save-every N to write one)")
        if self.s.fsdp and self.world_size > 1:
            model_sd, optim_sd, state = read_checkpoint(path)
            D.load_full_state_dicts(self.model, self.optimizer, model_sd, optim_sd)
            set_rng_state(state["rng"])
        else:
            state = load_checkpoint(path, self.model, self.optimizer)
        ranks = state.get("rng_ranks")
        if ranks and len(ranks) == self.world_size:
            set_rng_state(ranks[self.rank])
        elif self.rank:  # saved by another number of processes: rank 0 goes on from its state, the others draw their own
            torch.manual_seed(resume_seed(self.job.seed, self.rank, state["step"]))
        self.step, self.tokens_seen, self.elapsed = state["step"], state["tokens_seen"], state["elapsed"]
        if self.s.max_steps is None and self.s.time_budget is not None:
            self.total_steps = state.get("total_steps")  # the plan of the interrupted run
        self.job.load_state(state.get("job", {}))
        return state

    def checkpoint(self) -> dict[str, torch.Tensor] | None:
        """Write checkpoint `step` (every rank takes part: RNG states; FSDP gathers the tensors); rank 0 writes.
        Returns the gathered weights of a sharded model (for the job's model folder), else None."""
        rngs = D.gather_objects(rng_state(), self.ctx)
        model_sd, optim_sd = D.full_state_dicts(self.model, self.optimizer, self.ctx, self.s.fsdp)
        if self.rank != 0:
            return None
        state = {"tokens_seen": self.tokens_seen, "elapsed": self.elapsed, "total_steps": self.total_steps,
                 "data_position": {"next_step": self.step, "seed": self.job.seed}, "world_size": self.world_size,
                 "rng": rngs[0], "rng_ranks": rngs, "job": self.job.state(), **self.job.checkpoint_info()}
        sharded = self.s.fsdp and self.world_size > 1
        save_checkpoint(self.out, self.step, model_sd if sharded else self.model, optim_sd, state,
                        keep=self.s.keep_checkpoints)
        return model_sd if sharded else None

    # time budget ---------------------------------------------------------------------------------------------
    def _plan(self, t_start: float, step_times: list[float]) -> None:
        """Fix the step count of a --time-budget run from the measured cost of steps and one evaluation."""
        t = time.perf_counter()
        self._eval_at_plan = self.job.evaluate(self.s.precision)
        eval_cost = time.perf_counter() - t
        spent = self.elapsed + (time.perf_counter() - t_start)
        total, self.n_evals = planned_steps(self.step, spent, self.s.time_budget,
                                            sorted(step_times)[len(step_times) // 2], eval_cost, self.s.max_steps)
        self.total_steps = int(D.broadcast_float(total, self.ctx))  # rank 0's clock decides for all
        self.planned_at = (self.step, spent)
        self.job.warmup(self.total_steps)  # a warm-up left out is fixed by this plan, kept on replans

    def _replan(self, t_start: float) -> None:
        """Re-fit a --time-budget run's step count to the speed measured since planning (the schedule stretches)."""
        spent = self.elapsed + (time.perf_counter() - t_start)
        total = replanned_steps(self.step, spent, self.planned_at, self.s.time_budget, self.s.max_steps)
        if total is not None:
            self.total_steps = int(D.broadcast_float(total, self.ctx))

    # the loop ---------------------------------------------------------------------------------------------------
    def fit(self) -> dict[str, Any]:
        """Run the steps left; the job's `finish` result. A new run that fails before its first save leaves nothing."""
        writes = self.rank == 0 and self.out is not None
        created = writes and not self.out.exists()
        if writes:
            try:
                self.out.mkdir(parents=True, exist_ok=True)
            except OSError as exc:
                raise TrainingError(f"cannot create --out {self.out} ({exc.strerror}); choose another --out") from None
        bar = None
        try:
            if writes:
                self._remove_leftovers()
                self.job.start(self.out)
                self.metrics.truncate(self.step) if self.s.resume else self.metrics.reset()
            bar = progress_bar(self.s.progress and self.rank == 0, total=self.total_steps, initial=self.step,
                               unit="step", dynamic_ncols=True, leave=True)
            # no terminal to draw the bar on (output to a file or a pipe): a plain line at each evaluation
            self._report_lines = self.s.progress and self.rank == 0 and bar.disable
            self.job.model.train()
            self._loop(bar)
        except BaseException:
            if writes and not self.s.resume and not checkpoints(self.out):
                self._discard(created)
            raise
        finally:
            if bar is not None:
                bar.close()  # before the CLI prints an error, so that the error is a line of its own
        return self.job.finish(self)

    def _remove_leftovers(self) -> None:
        """Temporary files of a run killed while writing (atomic writes of its files, a staged model folder)."""
        for path in self.out.glob(".*"):
            if path.is_dir() and path.name.startswith(tuple(self.job.temporary_prefixes)):
                shutil.rmtree(path, ignore_errors=True)
            elif path.is_file() and path.name.endswith(".tmp") and path.name[1:].startswith(
                    tuple(f"{name}." for name in self.job.written_files + ("metrics.jsonl",))):
                path.unlink(missing_ok=True)

    def _discard(self, created: bool) -> None:
        """Remove what a new run wrote before its first save (the whole --out folder if the run made it)."""
        if created:
            shutil.rmtree(self.out, ignore_errors=True)
        else:
            for name in self.job.written_files + ("metrics.jsonl",):
                (self.out / name).unlink(missing_ok=True)

    def _loop(self, bar) -> None:
        s = self.s
        t_start = time.perf_counter()
        step_times: list[float] = []
        schedule = EvalSaveSchedule(s.eval_every, s.save_every, s.log_every, self.step, self.step)
        while self.total_steps is None or self.step < self.total_steps:
            t0 = time.perf_counter()
            loss = self.job.train_step(self.step)
            self.step += 1
            dt = time.perf_counter() - t0
            step_times.append(dt)
            row: dict[str, Any] = {"step": self.step, "loss": loss, "lr": self.optimizer.param_groups[0]["lr"]}
            if self.grad_norm is not None:
                row["grad_norm"] = self.grad_norm
            if self.total_steps is None and len(step_times) >= CALIBRATION_STEPS:
                self._plan(t_start, step_times[2:])
                bar.total = self.total_steps
            out_of_time = s.time_budget is not None and self.elapsed + time.perf_counter() - t_start >= s.time_budget
            if s.time_budget is not None:
                out_of_time = bool(D.broadcast_float(out_of_time, self.ctx))
            if out_of_time:  # also while still measuring: the budget is spent
                self.total_steps = self.step
            if self.total_steps is None and s.max_steps is not None and self.step >= s.max_steps:
                self.total_steps = self.step  # --max-steps below the time budget's calibration steps
            done = self.total_steps is not None and self.step >= self.total_steps
            every = schedule.every(self.total_steps, self.planned_at, self.n_evals) if s.spaced else 0
            eval_due, save_due = schedule.eval_due(self.step, every), schedule.save_due(self.step, every)
            if self._eval_at_plan is not None:
                result, self._eval_at_plan = self._eval_at_plan, None
            elif done or eval_due:
                result = self.job.evaluate(s.precision)
            else:
                result = None
            if result is not None:
                schedule.evaluated(self.step)
                if not math.isfinite(result.get("loss", 0.0)):  # the weights are ruined: saving them would only mislead
                    raise TrainingError(f"the validation loss became {result['loss']} at step {self.step}; "
                                        + self.divergence_hint())
            if result is not None and not done and s.time_budget is not None and self.planned_at is not None:
                self._replan(t_start)
                bar.total = self.total_steps
            row.update(self.job.step_row(self, dt, result))
            row["elapsed"] = round(self.elapsed + time.perf_counter() - t_start, 3)
            self.last_row = row
            if self.rank == 0 and (result is not None or done or self.step % s.log_every == 0):
                if self.metrics is not None:
                    self.metrics.append(row)
                self.job.logged(self, row)
            bar.update(1)
            bar.set_postfix(self.job.postfix(row, result))
            if result is not None and self._report_lines:
                print(self.job.report_line(self, row, result), file=sys.stderr, flush=True)
            if (done and s.spaced) or save_due:
                schedule.saved(self.step)
                self.elapsed += time.perf_counter() - t_start
                t_start = time.perf_counter()
                self.job.save(self, self.checkpoint(), final=done)
        self.elapsed += time.perf_counter() - t_start
