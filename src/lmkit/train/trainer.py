"""Pre-training (`lmkit train`) as a job of the one training loop (train/loop.py).

One optimizer step s (0-based) reads the rows `PackedStream.rows(seed, s, ...)`, which the `--objective` turns
into its batch (masking drawn from a generator seeded by (seed, s, rank)), cut into micro-batches; the loop
minimises sum of nats / number of targets of the whole step and saves checkpoints from which a resumed run
continues with the losses the uninterrupted run would have had.
"""
from __future__ import annotations

import dataclasses
import shutil
import tempfile
from pathlib import Path
from typing import Any

import torch
from safetensors import SafetensorError

from lmkit.device import to_device
from lmkit.models import build_model
from lmkit.train import distributed as D
from lmkit.train.checkpoint import write_error
from lmkit.train.config import TrainConfig
from lmkit.train.host_memory import keep_freed_memory
from lmkit.train.job import Job
from lmkit.train.loop import LoopSettings, TrainLoop
from lmkit.train.metrics import plot_losses
from lmkit.train.optim import build_optimizer
from lmkit.train.scheduled import ScheduledSampling, teacher_forcing_probability
from lmkit.train.seeds import seed_int, train_seed
from lmkit.train.setup import TOKENIZER_FILES, TrainingSetup, prepare_training
from lmkit.train.sizing import Sizing, applies as sizing_applies, size_model

DEFAULT_STEPS = 1000
MODEL_TMP = ".model."  # the model folder is written here first, then moved into --out


class Trainer(Job):
    """Pre-training as a job of the one loop (train/loop.py): the packed stream's rows of step s, the
    `--objective`'s loss, the model folder and loss curve at every save; `fit()` runs it and returns the last
    evaluation.

    `setup`, when given, is a prepared `TrainingSetup` trained as it is (its own cfg; no preparing, no sizing):
    how sizing times each candidate shape through the trainer's own step."""

    written_files = TOKENIZER_FILES + ("loss_curve.png",)
    temporary_prefixes = (MODEL_TMP,)

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
        self.seed = cfg.seed
        self.out, self.checkpoint, self.objective = setup.out, setup.checkpoint, setup.objective
        if cfg.scheduled_sampling:  # two passes a step: the model's own predictions mixed into its inputs
            self.objective = dataclasses.replace(self.objective, loss=ScheduledSampling(cfg.scheduled_sampling).loss)
        self.model_config, self.model = setup.model_config, setup.model
        data = setup.data
        self.tokenizer, self.stream, self.bos_id, self.pad_id = data.tokenizer, data.stream, data.bos_id, data.pad_id
        self.val_rows, self.val_mask, self.val_bytes = data.val_rows, data.val_mask, data.val_bytes
        self.data_identity = data.identity
        max_steps = DEFAULT_STEPS if cfg.max_steps is None and cfg.time_budget is None else cfg.max_steps
        settings = LoopSettings(lr=cfg.lr, max_steps=max_steps, time_budget=cfg.time_budget,
                                min_lr=cfg.lr * cfg.min_lr_ratio, lr_schedule=cfg.lr_schedule, grad_clip=cfg.grad_clip,
                                precision=cfg.precision, log_every=cfg.log_every, eval_every=cfg.eval_every,
                                save_every=cfg.save_every, keep_checkpoints=cfg.keep_checkpoints, spaced=True,
                                resume=cfg.resume, progress=cfg.progress, fsdp=cfg.fsdp)
        self.loop = TrainLoop(self, settings, self.out, self.ctx)
        self.engine, self.optimizer = self.loop.engine, self.loop.optimizer
        self._last: dict[str, Any] = {}
        if cfg.resume:
            self.loop.resume(self.checkpoint)
        else:
            torch.manual_seed(train_seed(cfg.seed, rank))  # a resumed run has its RNG states restored instead

    # what the loop reads -------------------------------------------------------------------------------
    @property
    def step(self) -> int:
        return self.loop.step

    @property
    def total_steps(self) -> int | None:
        return self.loop.total_steps

    @property
    def _n_evals(self) -> int:
        return self.loop.n_evals

    def build_optimizer(self) -> torch.optim.Optimizer:
        return build_optimizer(self.model, self.cfg.lr, self.cfg.weight_decay, kind=self.cfg.optimizer)

    def warmup(self, total_steps: int | None) -> int:
        return self.cfg.fix_warmup(total_steps)

    def micro_batches(self, step: int, rank: int, world_size: int) -> list[dict[str, torch.Tensor]]:
        """The rows `PackedStream.rows(seed, step, ...)` as the objective's batch, cut into micro-batches."""
        cfg = self.cfg
        rows = to_device(self.stream.rows(cfg.seed, step, cfg.batch_size, rank, world_size), self.device)
        generator = torch.Generator().manual_seed(seed_int("batch", cfg.seed, step, rank))
        batch = self.objective.build_batch(rows, self.pad_id, generator)
        if cfg.scheduled_sampling:
            batch["teacher_forcing"] = torch.full((len(rows),), teacher_forcing_probability(cfg.scheduled_sampling, step))
        micro = cfg.micro_batch_size if world_size == 1 else max(1, cfg.micro_batch_size // world_size)
        return [{k: v[start:start + micro] for k, v in batch.items()} for start in range(0, len(rows), micro)]

    def evaluate(self, precision: str | None = None) -> dict[str, float]:
        return self.objective.evaluate(self.model, rows=self.val_rows, mask=self.val_mask, num_bytes=self.val_bytes,
                                       batch_size=self.cfg.eval_batch_size, precision=precision or self.cfg.precision)

    def checkpoint_info(self) -> dict[str, Any]:
        self.cfg.fix_warmup(self.loop.total_steps)  # recorded even when the budget ran out while timing the first steps
        return {"train_config": self.cfg.to_dict(), "model_config": self.model_config.to_dict(),
                "data": self.data_identity}

    def start(self, out: Path) -> None:
        # with tokenizer_config.json naming its special tokens, so transformers' AutoTokenizer reads
        # the run as lmkit does (without it, a bert folder gets BertTokenizer's [UNK]/[MASK] defaults)
        self.tokenizer.save_pretrained(out)

    def step_row(self, loop, seconds: float, result: dict[str, float] | None) -> dict[str, Any]:
        row: dict[str, Any] = {}
        if result is not None:  # a masked LM reports its masked loss and accuracy instead of perplexity and bpb
            short = {"perplexity": "ppl"}
            row.update({f"val_{short.get(k, k)}": v for k, v in result.items() if k not in ("tokens", "bytes")})
            self._last = {f"val_{k}": v for k, v in result.items()}
        row.update(tokens=loop.tokens_seen, tok_per_s=round(self.stream.seq_len * self.cfg.batch_size / seconds, 1))
        return row

    def postfix(self, row: dict[str, Any], result: dict[str, float] | None) -> dict[str, str]:
        shown = "bpb" if result and "bpb" in result else "masked_accuracy"
        return {"loss": f"{row['loss']:.3f}", "tok_s": f"{row['tok_per_s']:.0f}",
                **({f"val_{shown}": f"{result[shown]:.3f}"} if result else {})}

    def report_line(self, loop, row: dict[str, Any], result: dict[str, float]) -> str:
        scores = ", ".join(f"val_{k} {result[k]:.4f}" for k in ("bpb", "masked_accuracy", "nsp_accuracy") if k in result)
        return (f"step {loop.step}/{loop.total_steps or '?'}: loss {row['loss']:.4f}, val_loss {result['loss']:.4f}, "
                f"{scores}, {row['tok_per_s']:.0f} tokens/s")

    def save(self, loop, gathered: dict[str, torch.Tensor] | None, final: bool) -> None:
        """After the checkpoint: the model folder (config.json, model.safetensors) and the loss plot (rank 0)."""
        if self.rank != 0:
            return
        model = self.model
        if gathered is not None:  # a one-process copy of the gathered weights for the model folder
            model = build_model(self.model_config)
            model.load_state_dict(gathered, strict=False)
        try:
            tmp = Path(tempfile.mkdtemp(prefix=MODEL_TMP, dir=self.out))
            try:
                model.save_pretrained(tmp)
                for f in sorted(tmp.iterdir()):
                    f.replace(self.out / f.name)
            finally:
                shutil.rmtree(tmp, ignore_errors=True)
        except (OSError, SafetensorError) as exc:
            raise write_error(f"the model folder {self.out}", exc, f"checkpoint step-{loop.step:08d} is saved") from None
        plot_losses(loop.metrics.read(), self.out / "loss_curve.png", title=f"{self.cfg.preset} on {' '.join(self.cfg.corpus)}")

    def finish(self, loop) -> dict[str, Any]:
        result = {"step": loop.step, "train_tokens": loop.tokens_seen, "elapsed": loop.elapsed, **self._last}
        if hasattr(self.stream, "realised"):  # a mixture: the share of tokens each source gave
            result["mixture"] = self.stream.realised(self.cfg.seed, loop.step, self.cfg.batch_size)
        return result

    def fit(self) -> dict[str, Any]:
        return self.loop.fit()


def train(cfg: TrainConfig | None = None, explicit: set[str] | None = None, **kwargs: Any) -> dict[str, Any]:
    """Build a `Trainer` from `cfg` (or keyword settings) and run it."""
    cfg = cfg or TrainConfig(**kwargs)
    return Trainer(cfg, explicit=explicit).fit()
