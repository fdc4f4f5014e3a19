"""The training loop: data, model, AdamW, schedule, accumulation, evaluation, checkpoints.

One optimizer step s (0-based) reads the rows `PackedStream.rows(seed, s, ...)`, splits them
into micro batches, and minimises sum of nats / number of targets of the whole step, so
accumulating k micro batches gives the gradient of one batch k times larger. Every random
choice is a function of (seed, step, rank) or of RNG states kept in the checkpoint, so a
resumed run continues with the losses the uninterrupted run would have had.
"""
from __future__ import annotations

import math
import shutil
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

import torch
from safetensors import SafetensorError

from lmkit.device import to_device
from lmkit.errors import TrainingError
from lmkit.evaluate.perplexity import autocast
from lmkit.models import build_model
from lmkit.objectives import with_aux_loss
from lmkit.progress import progress_bar
from lmkit.train import distributed as D
from lmkit.train.budget import planned_steps, replanned_steps
from lmkit.train.checkpoint import (checkpoints, load_checkpoint, read_checkpoint, rng_state, save_checkpoint,
                                    set_rng_state, write_error)
from lmkit.train.config import TrainConfig
from lmkit.train.host_memory import keep_freed_memory
from lmkit.train.metrics import MetricsLog, plot_losses
from lmkit.train.optim import build_optimizer, lr_at, set_lr
from lmkit.train.schedule import EvalSaveSchedule
from lmkit.train.seeds import resume_seed, seed_int, train_seed
from lmkit.train.setup import TOKENIZER_FILES, TrainingSetup, prepare_training
from lmkit.train.sizing import Sizing, applies as sizing_applies, size_model

DEFAULT_STEPS = 1000
MODEL_TMP = ".model."  # the model folder is written here first, then moved into --out
CALIBRATION_STEPS = 8  # steps timed before a --time-budget run fixes its step count


class Trainer:
    """Trains the model a `TrainConfig` describes; `fit()` runs it and returns the last evaluation.

    `setup`, when given, is a prepared `TrainingSetup` trained as it is (its own cfg; no preparing, no sizing):
    how sizing times each candidate shape through the trainer's own step."""

    def __init__(self, cfg: TrainConfig, explicit: set[str] | None = None, rank: int = 0, world_size: int = 1,
                 device: str | torch.device = "cpu", setup: TrainingSetup | None = None):
        self.rank, self.world_size, self.device = rank, world_size, torch.device(device)
        if self.device.type == "cpu":
            keep_freed_memory()  # large activations stay in the heap between steps (see host_memory)
        self.ctx = D.DistContext(rank, world_size, self.device.index or 0, self.device,
                                 torch.distributed.get_backend() if world_size > 1 else None)
        # local set-up (no collectives): under torchrun every rank then learns whether all ranks got through it
        self.sizing: Sizing | None = None  # how a --time-budget run's model was sized, when it was
        if setup is None:  # given: a prepared set-up (sizing times candidate models through their own trainers)
            with D.agree_on_setup(self.ctx):
                setup = prepare_training(cfg, explicit, rank, world_size, self.device)
                if sizing_applies(setup.cfg, world_size):
                    setup, self.sizing = size_model(
                        setup, lambda candidate: Trainer(candidate.cfg, device=self.device, setup=candidate))
        self.cfg = cfg = setup.cfg
        self.out, self.checkpoint, self.objective = setup.out, setup.checkpoint, setup.objective
        self.model_config, self.model = setup.model_config, setup.model
        data = setup.data
        self.tokenizer, self.stream, self.bos_id, self.pad_id = data.tokenizer, data.stream, data.bos_id, data.pad_id
        self.val_rows, self.val_mask, self.val_bytes = data.val_rows, data.val_mask, data.val_bytes
        self.data_identity = data.identity
        self.engine = D.wrap_model(self.model, self.ctx, cfg.fsdp)  # what the step calls: DDP / FSDP / the model
        self.loss_scale = D.loss_scale(self.ctx, cfg.fsdp)
        self.optimizer = build_optimizer(self.model, cfg.lr, cfg.weight_decay, kind=cfg.optimizer)
        self.step, self.tokens_seen, self.elapsed = 0, 0, 0.0
        self.total_steps = cfg.max_steps if cfg.time_budget is None else None
        if cfg.max_steps is None and cfg.time_budget is None:
            self.total_steps = DEFAULT_STEPS
        self.metrics = MetricsLog(self.out / "metrics.jsonl")
        if cfg.resume:
            state = self._load(self.checkpoint)
            self.step, self.tokens_seen, self.elapsed = state["step"], state["tokens_seen"], state["elapsed"]
            if cfg.max_steps is None and cfg.time_budget is not None:
                self.total_steps = state.get("total_steps")  # the plan of the interrupted run
        if not cfg.resume:
            torch.manual_seed(train_seed(cfg.seed, rank))  # a resumed run has its RNG states restored instead

    # one optimizer step ---------------------------------------------------------------------------
    def _all_reduce(self, value: torch.Tensor) -> torch.Tensor:
        """Sum over processes (one process: itself). torchrun support hooks in here."""
        return D.all_reduce_sum(value, self.ctx)

    def train_step(self, step: int) -> float:
        """Optimizer step `step`; returns its mean training loss in nats per token (over all ranks)."""
        cfg = self.cfg
        total = self.total_steps or 10**9  # before a time budget is planned only the warm-up applies
        set_lr(self.optimizer, lr_at(step, cfg.lr, cfg.fix_warmup(self.total_steps), total, cfg.lr * cfg.min_lr_ratio))
        rows = to_device(self.stream.rows(cfg.seed, step, cfg.batch_size, self.rank, self.world_size), self.device)
        generator = torch.Generator().manual_seed(seed_int("batch", cfg.seed, step, self.rank))
        batch = self.objective.build_batch(rows, self.pad_id, generator)
        count = self._all_reduce(torch.tensor(float(self.objective.count(batch)))).item()
        micro = cfg.micro_batch_size if self.world_size == 1 else max(1, cfg.micro_batch_size // self.world_size)
        nats = torch.zeros((), dtype=torch.float64)
        n_micro = math.ceil(len(rows) / micro)
        for start in range(0, len(rows), micro):
            part = {k: v[start:start + micro] for k, v in batch.items()}
            with D.no_sync(self.engine, skip=start + micro < len(rows)):  # all-reduce once, after the last
                with autocast(self.device, cfg.precision):
                    loss_sum, aux = self.objective.loss(self.engine, part)
                # gradients are summed over micro-batches and ranks: each adds its share of the aux loss
                loss = with_aux_loss(loss_sum.sum / max(count, 1), aux, self.model_config.router_aux_loss_coef,
                                     n_micro * self.world_size)
                (loss * self.loss_scale if self.loss_scale != 1.0 else loss).backward()
            nats += loss_sum.sum.detach().double().cpu()
        mean = self._all_reduce(nats).item() / max(count, 1)
        if not math.isfinite(mean):
            self.optimizer.zero_grad(set_to_none=True)
            raise TrainingError(f"the training loss became {mean} at step {step + 1}; " + self._divergence_hint())
        if cfg.grad_clip:
            torch.nn.utils.clip_grad_norm_(self.model.parameters(), cfg.grad_clip)
        self.optimizer.step()
        self.optimizer.zero_grad(set_to_none=True)
        self.tokens_seen += int(count)
        return mean

    def _divergence_hint(self) -> str:
        return f"lower --lr (now {self.cfg.lr})" + (", or use --precision fp32" if self.cfg.precision == "bf16" else "")

    # evaluation and saving ---------------------------------------------------------------------------
    def evaluate(self, precision: str | None = None) -> dict[str, float]:
        return self.objective.evaluate(self.model, rows=self.val_rows, mask=self.val_mask, num_bytes=self.val_bytes,
                                       batch_size=self.cfg.eval_batch_size, precision=precision or self.cfg.precision)

    def _load(self, path: Path) -> dict[str, Any]:
        """Model, optimizer and RNG states of every rank from a checkpoint (the data position is the step)."""
        if self.cfg.fsdp and self.world_size > 1:
            model_sd, optim_sd, state = read_checkpoint(path)
            D.load_full_state_dicts(self.model, self.optimizer, model_sd, optim_sd)
            set_rng_state(state["rng"])
        else:
            state = load_checkpoint(path, self.model, self.optimizer)
        ranks = state.get("rng_ranks")
        if ranks and len(ranks) == self.world_size:
            set_rng_state(ranks[self.rank])
        elif self.rank:  # saved by another number of processes: rank 0 goes on from its state, the others draw their own
            torch.manual_seed(resume_seed(self.cfg.seed, self.rank, state["step"]))
        return state

    def save(self) -> None:
        """Checkpoint (for --resume), then the model folder (config.json, model.safetensors) and plot.

        Every rank takes part (RNG states; FSDP gathers the tensors); only rank 0 writes.
        """
        self.cfg.fix_warmup(self.total_steps)  # recorded even when the budget ran out while timing the first steps
        rngs = D.gather_objects(rng_state(), self.ctx)
        model_sd, optim_sd = D.full_state_dicts(self.model, self.optimizer, self.ctx, self.cfg.fsdp)
        if self.rank != 0:
            return
        state = {"tokens_seen": self.tokens_seen, "elapsed": self.elapsed, "total_steps": self.total_steps,
                 # the batch of step s is a function of (seed, s, rank, world size): the next step is the position
                 "data_position": {"next_step": self.step, "seed": self.cfg.seed},
                 "train_config": self.cfg.to_dict(), "model_config": self.model_config.to_dict(),
                 "data": self.data_identity, "world_size": self.world_size,
                 "rng": rngs[0], "rng_ranks": rngs}
        sharded = self.cfg.fsdp and self.world_size > 1
        save_checkpoint(self.out, self.step, model_sd if sharded else self.model, optim_sd, state,
                        keep=self.cfg.keep_checkpoints)
        model = self.model
        if sharded:  # a one-process copy of the gathered weights for the model folder
            model = build_model(self.model_config)
            model.load_state_dict(model_sd, strict=False)
        try:
            tmp = Path(tempfile.mkdtemp(prefix=MODEL_TMP, dir=self.out))
            try:
                model.save_pretrained(tmp)
                for f in sorted(tmp.iterdir()):
                    f.replace(self.out / f.name)
            finally:
                shutil.rmtree(tmp, ignore_errors=True)
        except (OSError, SafetensorError) as exc:
            raise write_error(f"the model folder {self.out}", exc, f"checkpoint step-{self.step:08d} is saved") from None
        plot_losses(self.metrics.read(), self.out / "loss_curve.png", title=f"{self.cfg.preset} on {' '.join(self.cfg.corpus)}")

    def _plan(self, t_start: float, step_times: list[float]) -> None:
        """Fix the step count of a --time-budget run from the measured cost of steps and one evaluation."""
        t = time.perf_counter()
        self._eval_at_plan = self.evaluate()
        eval_cost = time.perf_counter() - t
        spent = self.elapsed + (time.perf_counter() - t_start)
        total, self._n_evals = planned_steps(self.step, spent, self.cfg.time_budget,
                                             sorted(step_times)[len(step_times) // 2], eval_cost, self.cfg.max_steps)
        self.total_steps = int(D.broadcast_float(total, self.ctx))  # rank 0's clock decides for all
        self._planned_at = (self.step, spent)
        self.cfg.fix_warmup(self.total_steps)  # a warm-up left out: a tenth of this plan at most, kept on replans

    def _replan(self, t_start: float) -> None:
        """Re-fit a --time-budget run's step count to the speed measured since planning (the schedule stretches)."""
        spent = self.elapsed + (time.perf_counter() - t_start)
        total = replanned_steps(self.step, spent, self._planned_at, self.cfg.time_budget, self.cfg.max_steps)
        if total is not None:
            self.total_steps = int(D.broadcast_float(total, self.ctx))

    # the loop ------------------------------------------------------------------------------------------
    def fit(self) -> dict[str, Any]:
        cfg = self.cfg
        created = not self.out.exists()
        try:
            self.out.mkdir(parents=True, exist_ok=True)
        except OSError as exc:
            raise TrainingError(f"cannot create --out {self.out} ({exc.strerror}); choose another --out") from None
        bar = None
        try:
            if self.rank == 0:
                self._remove_leftovers()
                # with tokenizer_config.json naming its special tokens, so transformers' AutoTokenizer reads
                # the run as lmkit does (without it, a bert folder gets BertTokenizer's [UNK]/[MASK] defaults)
                self.tokenizer.save_pretrained(self.out)
                self.metrics.truncate(self.step) if cfg.resume else self.metrics.reset()
            bar = progress_bar(cfg.progress and self.rank == 0, total=self.total_steps, initial=self.step,
                               unit="step", dynamic_ncols=True, leave=True)
            # no terminal to draw the bar on (output to a file or a pipe): a plain line at each evaluation
            self._report_lines = cfg.progress and self.rank == 0 and bar.disable
            return self._loop(bar)
        except BaseException:
            if self.rank == 0 and not cfg.resume and not checkpoints(self.out):
                self._discard(created)  # a run that never saved leaves nothing behind
            raise
        finally:
            if bar is not None:
                bar.close()  # before the CLI prints an error, so that the error is a line of its own

    def _remove_leftovers(self) -> None:
        """Temporary files of a run killed while writing (the model folder, atomic writes of its files)."""
        for path in self.out.glob(".*"):
            if path.is_dir() and path.name.startswith(MODEL_TMP):
                shutil.rmtree(path, ignore_errors=True)
            elif path.is_file() and path.name.endswith(".tmp") and path.name[1:].startswith(
                    tuple(f"{name}." for name in TOKENIZER_FILES + ("metrics.jsonl", "loss_curve.png"))):
                path.unlink(missing_ok=True)

    def _discard(self, created: bool) -> None:
        """Remove what a new run wrote before its first save (the whole --out folder if the run made it)."""
        if created:
            shutil.rmtree(self.out, ignore_errors=True)
        else:
            for name in TOKENIZER_FILES + ("metrics.jsonl",):
                (self.out / name).unlink(missing_ok=True)

    def _loop(self, bar) -> dict[str, Any]:
        cfg = self.cfg
        t_start = time.perf_counter()
        step_times: list[float] = []
        last: dict[str, Any] = {}
        self._eval_at_plan, self._planned_at, self._n_evals = None, None, 10
        schedule = EvalSaveSchedule(cfg.eval_every, cfg.save_every, cfg.log_every, self.step, self.step)
        while self.total_steps is None or self.step < self.total_steps:
            t0 = time.perf_counter()
            loss = self.train_step(self.step)
            self.step += 1
            dt = time.perf_counter() - t0
            step_times.append(dt)
            row: dict[str, Any] = {"step": self.step, "loss": loss, "lr": self.optimizer.param_groups[0]["lr"]}
            if self.total_steps is None and len(step_times) >= CALIBRATION_STEPS:
                self._plan(t_start, step_times[2:])
                bar.total = self.total_steps
            out_of_time = cfg.time_budget is not None and self.elapsed + time.perf_counter() - t_start >= cfg.time_budget
            if cfg.time_budget is not None:
                out_of_time = bool(D.broadcast_float(out_of_time, self.ctx))
            if out_of_time:  # also while still measuring: the budget is spent
                self.total_steps = self.step
            if self.total_steps is None and cfg.max_steps is not None and self.step >= cfg.max_steps:
                self.total_steps = self.step  # --max-steps below the time budget's calibration steps
            done = self.total_steps is not None and self.step >= self.total_steps
            every = schedule.every(self.total_steps, self._planned_at, self._n_evals)
            eval_due, save_due = schedule.eval_due(self.step, every), schedule.save_due(self.step, every)
            if self._eval_at_plan is not None:
                result, self._eval_at_plan = self._eval_at_plan, None
            elif done or eval_due:
                result = self.evaluate()
            else:
                result = None
            if result is not None:
                schedule.evaluated(self.step)
                if not math.isfinite(result["loss"]):  # the weights are ruined: saving them would only mislead
                    raise TrainingError(f"the validation loss became {result['loss']} at step {self.step}; "
                                        + self._divergence_hint())
            if result is not None and not done and cfg.time_budget is not None and self._planned_at is not None:
                self._replan(t_start)
                bar.total = self.total_steps
            if result is not None:
                row.update(val_loss=result["loss"], val_ppl=result["perplexity"], val_bpb=result["bpb"])
                last = {f"val_{k}": v for k, v in result.items()}
            row.update(tokens=self.tokens_seen, tok_per_s=round(self.stream.seq_len * cfg.batch_size / dt, 1),
                       elapsed=round(self.elapsed + time.perf_counter() - t_start, 3))
            if self.rank == 0 and (result is not None or done or self.step % cfg.log_every == 0):
                self.metrics.append(row)
            bar.update(1)
            bar.set_postfix(loss=f"{loss:.3f}", tok_s=f"{row['tok_per_s']:.0f}",
                            **({"val_bpb": f"{result['bpb']:.3f}"} if result else {}))
            if result is not None and self._report_lines:
                print(f"step {self.step}/{self.total_steps or '?'}: loss {loss:.4f}, val_loss {result['loss']:.4f}, "
                      f"val_bpb {result['bpb']:.4f}, {row['tok_per_s']:.0f} tokens/s", file=sys.stderr, flush=True)
            if done or save_due:
                schedule.saved(self.step)
                self.elapsed += time.perf_counter() - t_start
                t_start = time.perf_counter()
                self.save()
        return {"step": self.step, "train_tokens": self.tokens_seen, "elapsed": self.elapsed, **last}


def train(cfg: TrainConfig | None = None, explicit: set[str] | None = None, **kwargs: Any) -> dict[str, Any]:
    """Build a `Trainer` from `cfg` (or keyword settings) and run it."""
    cfg = cfg or TrainConfig(**kwargs)
    return Trainer(cfg, explicit=explicit).fit()
