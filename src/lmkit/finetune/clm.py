"""Causal-LM fine-tuning on text (`lmkit finetune --task clm`), in full or with a PEFT method, as a job of the one
training loop: each step reads `stream.rows(seed, step, batch_size)` of a packed stream and minimises the mean
next-token loss over the step's targets (or another objective on the same rows: distillation's).
"""
from __future__ import annotations

import math
from contextlib import nullcontext
from pathlib import Path
from typing import Callable

import torch
from torch import nn

from lmkit.atomic import atomic_write_json, staged_folder
from lmkit.data import load_corpus
from lmkit.data.stream import PackedStream, eval_rows, tokenize_corpus
from lmkit.data.tokenize import special_ids
from lmkit.device import module_device, to_device
from lmkit.errors import ConfigError, TrainingError
from lmkit.evaluate.perplexity import evaluate_rows
from lmkit.finetune.regularize import build_anchor, parse_regularize
from lmkit.finetune.context import extend_window
from lmkit.finetune.longlora import group_size, longlora_settings, shifted_attention
from lmkit.finetune.common import (check_out, check_run, default_lr, fitting_length, model_folder, peft_for_task,
                                   save_model_folder)
from lmkit.objectives import next_token_targets
from lmkit.peft.model import trainable_summary
from lmkit.train import distributed
from lmkit.train.job import Job, Objective
from lmkit.train.loop import LoopSettings, TrainLoop
from lmkit.train.optim import build_optimizer
from lmkit.train.objective import CLM


FISHER_ROWS = 16  # sequences of the pre-training text that estimate EWC's Fisher diagonal


def sequence_loss(model: nn.Module, rows: torch.Tensor) -> torch.Tensor:
    """Mean next-token loss of packed rows (no padding)."""
    logits = model(rows[:, :-1]).logits
    return torch.nn.functional.cross_entropy(logits.flatten(0, 1).float(), rows[:, 1:].reshape(-1))


class CausalLMJob(Job):
    """Rows of a packed stream, an objective on them (default: next-token prediction), AdamW on what trains."""

    def __init__(self, model: nn.Module, stream, pad_id: int, batch_size: int, lr: float, warmup_steps: int,
                 seed: int = 0, weight_decay: float = 0.0, objective: Objective | None = None,
                 log: Callable[[dict], None] | None = None, data: "CausalLMData | None" = None, pruning=None):
        for flag, value in (("--batch-size", batch_size),):
            if not isinstance(value, int) or value < 1:
                raise TrainingError(f"{flag} must be at least 1, got {value}")
        if not 0 < lr < math.inf:
            raise TrainingError(f"--lr must be a positive number, got {lr}")
        if not any(p.requires_grad for p in model.parameters()):
            raise TrainingError("the model has no trainable parameters; add a PEFT method or unfreeze some layers")
        self.model, self.stream, self.pad_id, self.batch_size = model, stream, pad_id, batch_size
        self.lr, self.warmup_steps, self.seed, self.weight_decay = lr, warmup_steps, seed, weight_decay
        self.objective = objective or CLM
        self.log, self.data, self.history = log, data, []
        self.pruning = pruning  # before_step(model, step) / after_step(model): masks held through training

    def train_step(self, step: int) -> float:
        if self.pruning is None:
            return self.loop.train_step(step)
        self.pruning.before_step(self.model, step)
        loss = self.loop.train_step(step)
        self.pruning.after_step(self.model)  # the optimizer moved pruned weights: zero them again
        return loss

    def build_optimizer(self) -> torch.optim.Optimizer:
        return build_optimizer(self.model, self.lr, self.weight_decay)

    def warmup(self, total_steps: int | None) -> int:
        return self.warmup_steps

    def micro_batches(self, step: int, rank: int, world_size: int) -> list[dict[str, torch.Tensor]]:
        # one process reads the stream as a plain (seed, step, batch) -> rows function; ranks read their shares
        rows = self.stream.rows(self.seed, step, self.batch_size, *((rank, world_size) if world_size > 1 else ()))
        return [self.objective.build_batch(rows, self.pad_id, None)]

    def evaluate(self, precision: str) -> dict[str, float] | None:
        return None if self.data is None else self.data.evaluate(self.model)

    def step_row(self, loop, seconds: float, result: dict | None) -> dict:
        return {**getattr(self.objective, "parts", {}), "tokens": loop.tokens_seen}

    def logged(self, loop, row: dict) -> None:
        self.history.append(row)
        if self.log is not None:
            self.log(row)


def train_causal_lm(model: nn.Module, stream, pad_id: int, steps: int, batch_size: int, lr: float = 1e-3,
                    warmup_steps: int = 20, seed: int = 0, weight_decay: float = 0.0, grad_clip: float = 1.0,
                    objective: Objective | None = None, log: Callable[[dict], None] | None = None, out=None,
                    precision: str = "fp32", lr_schedule: str = "cosine", save_every: int | None = None,
                    resume: bool = False, log_every: int = 1, data: "CausalLMData | None" = None,
                    pruning=None, anchor=None) -> list[dict]:
    """Train `model` on `steps` batches of `stream.rows(seed, step, batch_size)` in the one loop (learning rate
    warming up over `warmup_steps`, then `lr_schedule` down to a tenth); the logged rows. With `out`:
    out/metrics.jsonl as it goes and, with `save_every`, checkpoints that `resume` continues from."""
    if not isinstance(steps, int) or steps < 1:
        raise TrainingError(f"--max-steps must be at least 1, got {steps}")
    ctx = distributed.setup(module_device(model))  # where model_folder put it
    job = CausalLMJob(model, stream, pad_id, batch_size, lr, warmup_steps, seed, weight_decay, objective,
                      log if ctx.is_main else None, data, pruning)
    settings = LoopSettings(lr=lr, max_steps=steps, min_lr=0.1 * lr, lr_schedule=lr_schedule, grad_clip=grad_clip,
                            precision=precision, log_every=log_every, save_every=save_every, resume=resume)
    loop = TrainLoop(job, settings, out, ctx)
    if anchor is not None:  # L2-SP / EWC (finetune/regularize.py): the pull toward the starting weights
        anchor.attach(loop.optimizer)
    if resume:
        loop.resume()
        job.history = [r for r in loop.metrics.read() if r["step"] <= loop.step]
    loop.fit()
    model.eval()
    return job.history


@torch.no_grad()
def next_token_accuracy(model: nn.Module, rows: torch.Tensor, mask: torch.Tensor, batch_size: int = 16) -> float:
    """Share of scored positions whose argmax prediction is the next token (rows/mask from `eval_rows`)."""
    model.eval()
    right = total = 0
    device = module_device(model)
    for start in range(0, len(rows), batch_size):
        inputs, targets = next_token_targets(to_device(rows[start:start + batch_size], device),
                                             to_device(mask[start:start + batch_size], device))
        pred = model(inputs).logits.argmax(-1)
        keep = targets != -100
        right += int((pred[keep] == targets[keep]).sum())
        total += int(keep.sum())
    return right / max(total, 1)


class CausalLMData:
    """A corpus split into a packed training stream and validation rows, under a model's tokenizer."""

    def __init__(self, tokenizer, corpus, seq_len: int, max_val_docs: int | None = None, val_fraction: float = 0.05):
        self.tokenizer = tokenizer
        self.bos, self.pad = special_ids(tokenizer)
        train, val = load_corpus(corpus).split(val_fraction)
        self.stream = PackedStream(tokenize_corpus(train, tokenizer), self.bos, seq_len)
        self.val_rows, self.val_mask, self.val_bytes = eval_rows(tokenize_corpus(val, tokenizer), self.bos, self.pad,
                                                                 seq_len, max_val_docs)

    def evaluate(self, model: nn.Module, batch_size: int = 16) -> dict:
        """Validation loss (nats/token), perplexity, bits per byte and next-token accuracy."""
        was = model.training
        r = evaluate_rows(model, self.val_rows, self.val_mask, self.val_bytes, batch_size=batch_size)
        r["accuracy"] = next_token_accuracy(model, self.val_rows, self.val_mask, batch_size)
        model.train(was)
        return r


def causal_lm_data(model: nn.Module, tokenizer, corpus, seq_len: int | None, max_val_docs: int | None = None,
                   method: str = "full", settings: dict | None = None, flag: str = "--seq-len",
                   val_fraction: float = 0.05) -> CausalLMData:
    """CausalLMData of `corpus` in rows that fit the model (`fitting_length`, at most 256 tokens by default)."""
    scaling = model.config.rope_scaling or {}
    room = model.config.max_seq_len
    if seq_len is not None and scaling.get("rope_type", scaling.get("type")) == "dynamic":
        room = max(room, seq_len)  # dynamic NTK grows its base for rows past the trained context
    seq_len = fitting_length(room, method, settings or {}, seq_len, 256, flag)
    return CausalLMData(tokenizer, list(corpus), seq_len, max_val_docs, val_fraction)


def finetune_causal_lm_folder(model_dir, out, method: str = "lora", corpus=("pydocs",), steps: int = 100,
                              batch_size: int = 8, seq_len: int | None = None, lr: float | None = None, seed: int = 0,
                              max_val_docs: int | None = None, log=None, val_fraction: float = 0.05,
                              warmup_ratio: float | None = None, weight_decay: float = 0.0,
                              precision: str | None = None, lr_schedule: str = "cosine", save_every: int | None = None,
                              resume: bool = False, device=None, regularize: str | None = None,
                              forgetting_corpus=None, rope_scaling: str | None = None,
                              rope_factor: float | None = None, longlora: bool = False, s2_group: int | None = None,
                              **settings) -> dict:
    """Fine-tune the causal LM of `model_dir` on `corpus` with a PEFT method (or "full"); write to `out`.

    Rows are `seq_len` tokens (default: what fits the model's context, at most 256); `val_fraction` of the
    corpus's documents (by `Corpus.split`) are held out for the scores before and after. The learning rate
    warms up over round(warmup_ratio * steps) steps (None: a tenth of them, at most 20), then decays by cosine.

    `rope_scaling` (linear, dynamic or yarn) with `rope_factor` extends the model's RoPE window first
    (`context.extend_window`; `seq_len` is then the new length, default factor x the old one). `longlora` trains
    with S2-Attn in groups of `s2_group` tokens (default a quarter of the row) and, with LoRA, the embeddings and
    norms in full (`longlora.py`); the saved model attends in full.

    `out` gets the adapter in PEFT format (adapter_config.json + adapter_model.safetensors), or the whole
    model for "full" (and the merged model for LoRA/IA3 with `rope_scaling`, whose config carries the new
    RoPE), plus finetune.json with the validation scores before and after and the parameter counts,
    and metrics.jsonl as training goes (with `save_every`, checkpoints that `resume` continues from).

    `regularize` ("l2sp:LAMBDA" or "ewc:LAMBDA", `regularize.py`) pulls the weights toward the starting ones, EWC's
    Fisher estimated on `forgetting_corpus` (default pydocs); with `forgetting_corpus`, finetune.json also holds
    its validation scores before and after ("forgetting"): what the fine-tuning cost the model elsewhere.
    """
    check_out(out, model_dir)
    if not 0.0 < val_fraction < 1.0:
        raise TrainingError(f"--val-fraction must lie strictly between 0 and 1 (a share of the documents), got {val_fraction}")
    if warmup_ratio is not None and not 0.0 <= warmup_ratio <= 1.0:
        raise TrainingError(f"--warmup-ratio must lie in [0, 1] (a share of the steps), got {warmup_ratio}")
    if not 0.0 <= weight_decay < math.inf:
        raise TrainingError(f"--weight-decay must be a non-negative number, got {weight_decay}")
    precision = check_run(out, resume, save_every, precision, lr_schedule)
    model, tok = model_folder(model_dir, device)
    if rope_scaling is not None:
        seq_len = extend_window(model, rope_scaling, rope_factor, seq_len)
    elif rope_factor is not None:
        raise ConfigError("--rope-factor needs --rope-scaling linear|dynamic|yarn (how the window grows)")
    data = causal_lm_data(model, tok, corpus, seq_len, max_val_docs, method, settings, "--max-length", val_fraction)
    group = None
    if longlora:
        settings = longlora_settings(method, settings)
        group = group_size(data.stream.seq_len, s2_group)
    elif s2_group is not None:
        raise ConfigError("--s2-group needs --longlora (S2-Attn's group size)")
    before = data.evaluate(model)
    parse_regularize(regularize)  # a bad spec fails before any work
    old = None
    if forgetting_corpus is not None or (regularize or "").startswith("ewc"):
        old = causal_lm_data(model, tok, [forgetting_corpus or "pydocs"], data.stream.seq_len, max_val_docs, method,
                             settings, "--max-length")
    old_before = old.evaluate(model) if forgetting_corpus is not None else None
    torch.manual_seed(seed)
    tuned = peft_for_task(model, method, **settings)
    if method == "full":
        for p in tuned.parameters():
            p.requires_grad_(True)
    summary = trainable_summary(tuned)
    anchor = build_anchor(tuned, regularize, None if old is None else old.stream.rows(seed, 0, FISHER_ROWS),
                          sequence_loss)
    with shifted_attention(tuned, group) if longlora else nullcontext():
        history = train_causal_lm(tuned, data.stream, data.pad, steps, batch_size, lr or default_lr(method, "clm"),
                                  warmup_steps=min(20, steps // 10) if warmup_ratio is None else round(warmup_ratio * steps),
                                  seed=seed, weight_decay=weight_decay, log=log, out=out, precision=precision,
                                  lr_schedule=lr_schedule, save_every=save_every, resume=resume, anchor=anchor)
    after = data.evaluate(tuned)
    report = {"method": method, "steps": steps, "seconds": history[-1]["elapsed"] if history else 0.0,
              "precision": precision, **summary, "before": before, "after": after, "regularize": regularize}
    if old_before is not None:
        report["forgetting"] = {"corpus": forgetting_corpus, "before": old_before, "after": old.evaluate(tuned)}
    if not distributed.setup().is_main:  # under torchrun rank 0 writes
        return report
    if longlora:
        report["longlora"] = {"s2_group": group}
    if rope_scaling is not None:
        report["rope_scaling"] = dict(model.config.rope_scaling)
    if method != "full" and rope_scaling is not None:  # an adapter alone would lose the new RoPE: save it merged
        save_model_folder(tuned.merge_and_unload(), tok, out, {"finetune.json": report})
    elif method == "full":
        save_model_folder(tuned, tok, out, {"finetune.json": report})
    else:
        with staged_folder(out) as folder:
            tuned.save_adapter(folder)
            atomic_write_json(folder / "finetune.json", report, sort_keys=True)
    return report
