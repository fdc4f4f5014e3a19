"""`TrainConfig`: the settings of a training run, and per-preset defaults (recipes)."""
from __future__ import annotations

import dataclasses
import functools
import math
from dataclasses import dataclass, field
from typing import Any

import torch

from lmkit.config import ModelConfig, get_preset
from lmkit.errors import TrainingError
from lmkit.train.noise import parse_noise
from lmkit.train.optim import OPTIMIZERS, SCHEDULES
from lmkit.train.scheduled import parse_schedule
from lmkit.train.precision import bf16_supported, default_precision  # noqa: F401  (re-exported)

# Defaults per preset where the generic ones below do not fit; flags override them.
RECIPES: dict[str, dict[str, Any]] = {
    "tiny": dict(batch_size=8, lr=3e-3, warmup_steps=10),
    # the best validation bits per byte on pydocs in a 5-minute budget on 2 CPU cores: 128-token rows are the
    # shortest context worth generating from and cheaper in attention than 256; Muon for the hidden matrices
    # (train/muon.py) at AdamW's lr learns more per step than AdamW (2.01 against 2.08), and its Newton-Schulz
    # step costs about the same whatever the batch, so 24 rows spread it over more tokens than 16
    "default": dict(batch_size=24, seq_len=128, lr=3e-3, warmup_steps=50, optimizer="muon"),
}

GENERIC_WARMUP = 100  # warm-up steps of presets without a recipe for it

# Settings that change the numbers of a run: a resumed run must keep them.
RUN_DEFINING = ("preset", "objective", "corpus", "data", "batch_size", "micro_batch_size", "seq_len", "lr", "optimizer",
                "min_lr_ratio", "lr_schedule", "warmup_steps", "weight_decay", "grad_clip", "precision", "seed", "vocab_size", "val_fraction",
                "model_overrides", "noise", "scheduled_sampling", "fim_rate", "fim_spm_rate")


@dataclass
class TrainConfig:
    preset: str = "default"
    objective: str = "clm"
    corpus: list[str] = field(default_factory=lambda: ["pydocs"])
    out: str = "runs/default"
    max_steps: int | None = None          # None with no time budget: 1000
    time_budget: float | None = None      # seconds of training; sets the step count after a short measurement
    batch_size: int | None = None         # rows per optimizer step (the global batch under torchrun)
    micro_batch_size: int | None = None   # rows per forward/backward; batch_size / this = accumulation steps
    seq_len: int | None = None            # None: the preset's max_seq_len (at most 1024); the model's context
    lr: float | None = None
    min_lr_ratio: float = 0.1
    lr_schedule: str = "cosine"          # after the warm-up: cosine | linear (to min_lr) | constant (lr)
    warmup_steps: int | None = None       # None: the preset's, at most a tenth of the planned steps (warmup_for)
    weight_decay: float = 0.1
    optimizer: str | None = None          # adamw | muon (Muon for the hidden matrices); None: the preset's recipe
    grad_clip: float = 1.0
    precision: str | None = None          # fp32 | bf16; None: bf16 where the CPU has native bf16
    log_every: int = 10
    save_every: int | None = None         # None: about ten saves per run
    eval_every: int | None = None         # None: = save_every
    eval_batch_size: int = 16
    seed: int = 0
    resume: bool = False
    vocab_size: int | None = None         # tokenizer size; None: the preset's vocab_size
    val_fraction: float = 0.05
    progress: bool = True
    model_overrides: dict[str, Any] = field(default_factory=dict)
    data: str | None = None               # a folder of prepared token shards (`lmkit data prepare`); replaces corpus
    fsdp: bool = False                    # under torchrun: shard parameters, gradients and optimizer state (FSDP)
    keep_checkpoints: int = 3             # the newest K checkpoints stay on disk
    # a --time-budget run of the default preset: its shape sized from a scaling law and the measured speed
    # (train/sizing.py): "auto" (the pydocs law), a law's name or fit.json, or "off" (the preset as it is)
    sizing: str = "auto"
    noise: str | None = None              # --objective denoise: BART's noisings, comma-separated (train/noise.py)
    scheduled_sampling: str | None = None  # --objective clm: KIND:K, the teacher-forcing decay (train/scheduled.py)
    fim_rate: float = 0.5                 # --objective fim: share of document pieces made FIM examples
    fim_spm_rate: float = 0.5             # of those, the share in SPM order (the rest PSM)

    def resolved(self, model: ModelConfig | None = None, device: torch.device | str | None = None) -> "TrainConfig":
        """A copy with every None that has a default filled in (recipes first); `model`: the preset with the
        model overrides, when the caller has it already; `device`: where it trains (the default precision)."""
        recipe = RECIPES.get(self.preset, {})
        model = model or get_preset(self.preset, **self.model_overrides)
        # vocab_size (the tokenizer's target) is recorded so that a resumed run retrains the same tokenizer
        # warmup_steps left out stays None here: it depends on the planned steps (fix_warmup)
        generic = dict(batch_size=16, seq_len=min(model.max_seq_len, 1024), lr=1e-3, optimizer="adamw",
                       vocab_size=model.vocab_size)
        values = {k: getattr(self, k) if getattr(self, k) is not None else recipe.get(k, generic[k]) for k in generic}
        cfg = dataclasses.replace(self, **values)
        if cfg.precision is None:
            cfg.precision = default_precision(device)
        if cfg.micro_batch_size is None:
            cfg.micro_batch_size = cfg.batch_size
        cfg.check()
        return cfg

    def check(self) -> None:
        def positive(name: str) -> None:
            value = getattr(self, name)
            if value is not None and not 0 < value < math.inf:
                raise TrainingError(f"--{name.replace('_', '-')} must be a positive number, got {value}")

        for name in ("max_steps", "time_budget", "batch_size", "micro_batch_size", "seq_len", "lr", "log_every",
                     "save_every", "eval_every", "eval_batch_size"):
            positive(name)
        if self.keep_checkpoints < 1:
            raise TrainingError(f"--keep-checkpoints must be at least 1, got {self.keep_checkpoints}")
        if self.optimizer not in OPTIMIZERS:
            raise TrainingError(f"--optimizer must be one of {', '.join(OPTIMIZERS)}, got {self.optimizer!r}")
        if self.lr_schedule not in SCHEDULES:
            raise TrainingError(f"--lr-schedule must be one of {', '.join(SCHEDULES)}, got {self.lr_schedule!r}")
        if self.precision not in ("fp32", "bf16"):
            raise TrainingError(f"--precision must be fp32 or bf16, got {self.precision!r}")
        if self.batch_size % self.micro_batch_size:
            raise TrainingError(f"batch size {self.batch_size} is not a multiple of micro batch size {self.micro_batch_size}")
        if self.noise is not None:
            if self.objective != "denoise":
                raise TrainingError(f"--noise chooses BART's noisings of --objective denoise; drop it for "
                                    f"--objective {self.objective}")
            parse_noise(self.noise)  # unknown names refused before any data is read
        if self.scheduled_sampling is not None:
            if self.objective != "clm":
                raise TrainingError("--scheduled-sampling mixes a causal LM's own predictions into its inputs; it "
                                    f"applies to --objective clm, not {self.objective}")
            parse_schedule(self.scheduled_sampling)
        if self.warmup_steps is not None and self.warmup_steps < 0:
            raise TrainingError(f"--warmup-steps must be >= 0, got {self.warmup_steps}")

    def warmup_for(self, total_steps: int | None) -> int:
        """Warm-up steps of a run of `total_steps` (None: not planned yet): warmup_steps when given (or recorded),
        else the preset's (default 50, tiny 10, others 100) capped at total_steps // 10, so a short run reaches
        the peak learning rate."""
        if self.warmup_steps is not None:
            return self.warmup_steps
        preset = RECIPES.get(self.preset, {}).get("warmup_steps", GENERIC_WARMUP)
        return preset if total_steps is None else min(preset, total_steps // 10)

    def fix_warmup(self, total_steps: int | None) -> int:
        """The warm-up of the next step; a left-out one is fixed (and so recorded with the run) once total_steps is
        planned, so a resumed run keeps it. Before that (a --time-budget run still timing its first steps) the
        preset's, capped by max_steps."""
        if self.warmup_steps is None and total_steps is not None:
            self.warmup_steps = self.warmup_for(total_steps)
        return self.warmup_for(self.max_steps)

    def to_dict(self) -> dict[str, Any]:
        return dataclasses.asdict(self)
