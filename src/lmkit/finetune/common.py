"""What every fine-tuning job shares: the input folder read and checked, --out checked, PEFT applied with the task
head trained in full, rows that fit the model, default learning rates, and the loop's settings from the shared flags
(--lr --batch-size --max-steps --warmup-ratio --weight-decay --lr-schedule --seed --precision --save-every --resume).
"""
from __future__ import annotations

import json
import random
from pathlib import Path

from torch import nn

from lmkit.atomic import atomic_write_json, staged_folder
from lmkit.errors import CheckpointError, ConfigError
from lmkit.hub import load_model
from lmkit.peft.model import get_peft_model
from lmkit.tokenizers import load_tokenizer
from lmkit.train.checkpoint import CHECKPOINT_DIR
from lmkit.train.optim import SCHEDULES
from lmkit.train.precision import fast_precision

TASK_HEADS = ("classifier", "qa_outputs", "score")  # task heads a PEFT method trains in full, as the PEFT library does


def check_out(out, source, flag: str = "--model") -> None:
    """Refuse an --out that is the input model folder (the new files would replace the model being read) or a file."""
    if out is None:
        return
    if Path(out).expanduser().resolve() == Path(source).expanduser().resolve():
        raise ConfigError(f"--out {out} is the {flag} folder and would overwrite it; write to another folder")
    if Path(out).exists() and not Path(out).is_dir():
        raise ConfigError(f"--out {out} is a file; give a folder to write the model in")


def check_run(out, resume: bool, save_every: int | None, precision: str | None, lr_schedule: str) -> str:
    """Check the run flags every fine-tuning job shares; the precision to use (None: bf16 where the CPU multiplies
    bf16 natively and faster than fp32, `fast_precision`)."""
    if save_every is not None and save_every < 1:
        raise ConfigError(f"--save-every must be at least 1, got {save_every}")
    if lr_schedule not in SCHEDULES:
        raise ConfigError(f"--lr-schedule must be one of {', '.join(SCHEDULES)}, got {lr_schedule!r}")
    precision = precision or fast_precision()
    if precision not in ("fp32", "bf16"):
        raise ConfigError(f"--precision must be fp32 or bf16, got {precision!r}")
    saved = out is not None and (Path(out) / CHECKPOINT_DIR).is_dir()
    if resume and not saved:
        raise ConfigError(f"--resume: {out} holds no checkpoint to continue from; run without --resume (and with "
                          "--save-every N to write one)")
    if not resume and saved:
        raise ConfigError(f"--out {out} holds the checkpoints of an earlier run; pass --resume to continue it, or "
                          "choose another --out")
    return precision


def model_folder(path, device=None, encoders: bool = False):
    """(causal LM, tokenizer) of a folder that `lmkit train` wrote (tokenizer.json beside the weights); the model
    on `device` (None: the CPU). encoders: an `Encoder` (BERT, RoBERTa, DistilBERT with any head) is taken too."""
    folder = Path(path)
    if not (folder / "tokenizer.json").is_file():
        raise CheckpointError(f"{folder} has no tokenizer.json; pass a folder written by `lmkit train` (or add one)")
    model = load_model(folder, device=device)
    if type(model).__name__ != "CausalLM" and not (encoders and type(model).__name__ == "Encoder"):
        arch = model.config.architecture
        raise ConfigError(f"{folder} holds a{'n' if arch.startswith('e') else ''} {arch} model; this command works on "
                          "causal language models (a folder from `lmkit train`, or GPT-2, LLaMA, Mixtral)"
                          + (" and encoders (BERT, RoBERTa, DistilBERT)" if encoders else ""))
    if model.config.compression.get("quantization"):  # int8 layers hold no trainable or prunable weights
        raise ConfigError(f"{folder} holds an int8-quantized model (from `lmkit quantize`); pass the float model "
                          "it was made from")
    return model, load_tokenizer(folder / "tokenizer.json")


def save_model_folder(model: nn.Module, tokenizer, out, extra_json: dict | None = None) -> None:
    """The model (config.json + model.safetensors), its tokenizer.json and optional JSON files (`.jsonl`:
    a list of rows), staged beside `out` and moved in together, so an error or Ctrl-C changes nothing."""
    with staged_folder(out) as folder:
        model.save_pretrained(folder)
        tokenizer.save(str(folder / "tokenizer.json"))
        for name, obj in (extra_json or {}).items():
            if name.endswith(".jsonl"):
                (folder / name).write_text("".join(json.dumps(r) + "\n" for r in obj), encoding="utf-8")
            else:
                atomic_write_json(folder / name, obj, sort_keys=True)


def peft_for_task(model: nn.Module, method: str, **settings):
    """get_peft_model with the model's task head (if any) in modules_to_save; method "full" changes nothing."""
    if method == "full":
        return model
    if "modules_to_save" not in settings:
        present = {name.rpartition(".")[2] for name, _ in model.named_modules()}
        settings["modules_to_save"] = [h for h in TASK_HEADS if h in present]
    return get_peft_model(model, method, **settings)


def fitting_length(max_seq_len: int, method: str, settings: dict, asked: int | None, cap: int,
                   flag: str = "--max-length") -> int:
    """Tokens per row that fit the model's positions once prompt tuning's virtual tokens (which take positions
    before every row) are counted: `asked`, or min(room, cap) when None; a ConfigError naming the largest
    `flag` value that fits when `asked` does not."""
    if asked is not None and asked < 1:
        raise ConfigError(f"{flag} must be at least 1, got {asked}")
    virtual = settings.get("num_virtual_tokens", 10) if method == "prompt" else 0
    room = max_seq_len - virtual
    if room < 1:
        raise ConfigError(f"{virtual} virtual tokens fill all {max_seq_len} positions of the model; use "
                          f"--virtual-tokens {max_seq_len - 1} or less")
    if asked is None:
        return min(room, cap)
    if asked > room:
        raise ConfigError(f"rows of {asked} tokens{f' after {virtual} virtual tokens' if virtual else ''} do not fit "
                          f"the model's {max_seq_len} positions; use {flag} {room} or less")
    return asked


def default_lr(method: str, task: str = "clm") -> float:
    """Peak learning rates that suit each method (prompt-style methods train few, slow-moving parameters)."""
    if method == "full":
        return 3e-5 if task == "classify" else 1e-3
    return {"prompt": 1e-2, "prefix": 1e-2, "ia3": 1e-2}.get(method, 1e-3 if task == "classify" else 3e-3)


class ShuffledEpochs:
    """The examples of each optimizer step: epochs of a seeded shuffle, drawn alike on every rank; `state()` and
    `load_state()` carry the position for an exact resume."""

    def __init__(self, items: list, seed: int):
        self.items, self.rng, self.order = items, random.Random(seed), []

    def step(self, batch_size: int, micro_batch_size: int | None, rank: int, world_size: int) -> list[list]:
        """This rank's share of the next global batch of `batch_size` examples, in micro-batches."""
        batch = []
        while len(batch) < min(batch_size, len(self.items)):
            if not self.order:
                self.order = list(range(len(self.items)))
                self.rng.shuffle(self.order)
            batch.append(self.items[self.order.pop()])
        mine = batch[rank * len(batch) // world_size:(rank + 1) * len(batch) // world_size]
        micro = micro_batch_size or batch_size
        return [mine[i:i + micro] for i in range(0, len(mine), micro)]

    def state(self) -> dict:
        version, internal, gauss = self.rng.getstate()
        return {"rng": [version, list(internal), gauss], "order": self.order}

    def load_state(self, state: dict) -> None:
        version, internal, gauss = state["rng"]
        self.rng.setstate((version, tuple(internal), gauss))
        self.order = state["order"]


def run_epochs(job, cfg, per_epoch: int, precision: str, ctx) -> None:
    """Run `job` (a classification-style job) for cfg.epochs passes of `per_epoch` steps in the one loop, scoring and
    logging once a pass; resumed from --out's checkpoint with cfg.resume."""
    from lmkit.train.loop import LoopSettings, TrainLoop

    settings = LoopSettings(lr=cfg.lr, max_steps=cfg.epochs * per_epoch, lr_schedule=cfg.lr_schedule, grad_clip=1.0,
                            precision=precision, log_every=per_epoch, eval_every=per_epoch, save_every=cfg.save_every,
                            resume=cfg.resume, progress=cfg.progress)
    loop = TrainLoop(job, settings, cfg.out, ctx)
    if cfg.resume:
        loop.resume()
    loop.fit()


def step_loop(job, c, steps: int, precision: str, ctx):
    """The loop of a TRL-style job (DPO, the reward model, GRPO): `steps` optimizer steps at c.lr on c.lr_schedule,
    gradients clipped to 1 as TRL clips them, a metrics row every c.log_every steps."""
    from lmkit.train.loop import LoopSettings, TrainLoop

    return TrainLoop(job, LoopSettings(lr=c.lr, max_steps=steps, lr_schedule=c.lr_schedule, grad_clip=1.0,
                                       precision=precision, log_every=c.log_every, save_every=c.save_every,
                                       resume=c.resume), c.out, ctx)


def run_job(job_class, config, log) -> dict:
    """Build `job_class(config, ctx)` on every rank (one rank failing stops them all), run it, and return its report
    once every rank has finished (rank 0 logs)."""
    import torch

    from lmkit.device import resolve_device
    from lmkit.train import distributed

    ctx = distributed.setup(None if config.device is None else resolve_device(config.device, "device="))
    with distributed.agree_on_setup(ctx):
        job = job_class(config, ctx)
    report = job.run(log if ctx.is_main else None)
    if ctx.world_size > 1:
        torch.distributed.barrier()
    return report
