"""Train a small T5-style model on a task of (source, target) pairs and score it by corpus BLEU.

A job of the one training loop (train/loop.py) for pair data, which the packed stream does not hold: each step
draws a batch of pairs, the loss is teacher-forced cross-entropy per target token (EOS included), and every
`eval_every` steps the held-out sources are decoded greedily and scored with sacrebleu.
"""
from __future__ import annotations

import random
from pathlib import Path
from typing import Any

import torch

from lmkit.atomic import atomic_save_file, atomic_write_json
from lmkit.config import get_preset
from lmkit.evaluate.seq2seq import encode_pairs, evaluate_pairs
from lmkit.models import build_model
from lmkit.objectives import LossSum, next_token_loss, seq2seq_batch
from lmkit.train.job import Job
from lmkit.train.loop import LoopSettings, TrainLoop
from lmkit.train.metrics import plot_losses
from lmkit.train.optim import build_optimizer
from lmkit.train.scheduled import ScheduledSampling, teacher_forcing_probability


def fit_pairs(train: list[tuple[str, str]], test: list[tuple[str, str]], tokenizer, out: str | Path,
              preset: str = "t5-tiny", steps: int = 3000, time_budget: float | None = None, batch_size: int = 64,
              lr: float = 1e-3, warmup_steps: int = 100, eval_every: int = 500, seed: int = 0,
              log_every: int = 50, task: str | None = None, precision: str = "fp32", scheduled_sampling: str | None = None,
              **overrides: Any) -> dict[str, Any]:
    """Train `preset` on `train` pairs for `steps` (or until `time_budget` seconds); returns the last scores.

    out/ gets the model folder (config.json, model.safetensors, tokenizer.json), metrics.jsonl with
    `step`, `loss`, and on evaluation steps `val_loss`, `bleu`, ROUGE and exact match, and loss_curve.png;
    with `task` (a built-in task's name), task.json, so that `lmkit eval --model out` scores that task.
    Targets are labeled as `lmkit eval` labels references (`encode_pairs`): tokens + EOS, and for an mBART-style
    model (overrides decoder_start_from_labels=True, decoder_start_token_id=the target language code) `X </s> code`.
    """
    out = Path(out)
    torch.manual_seed(seed)
    specials = {k: tokenizer.token_to_id(v) for k, v in (("pad", "<pad>"), ("eos", "</s>"))}
    settings = {"decoder_start_token_id": specials["pad"], **overrides}  # T5 starts from pad, mBART from a code
    config = get_preset(preset, vocab_size=tokenizer.vocab_size, pad_token_id=specials["pad"],
                        eos_token_id=specials["eos"], **settings)
    job = PairsJob(build_model(config), tokenizer, train, test, specials["pad"], lr, warmup_steps, batch_size, seed,
                   scheduled_sampling)
    loop = TrainLoop(job, LoopSettings(lr=lr, max_steps=steps, time_budget=time_budget, min_lr=lr * 0.05,
                                       precision=precision, log_every=log_every, eval_every=eval_every), out)
    loop.fit()
    job.model.eval()
    job.model.save_pretrained(out)
    atomic_save_file(out / "tokenizer.json", lambda tmp: tokenizer.save(tmp))
    if task is not None:  # `lmkit eval --model out` then scores the task's held-out set
        atomic_write_json(out / "task.json", {"task": task}, sort_keys=True)
    plot_losses(loop.metrics.read(), out / "loss_curve.png", title=f"{preset} on numbers-to-words")
    return {"step": loop.step, "elapsed": loop.elapsed, **job.result}


class PairsJob(Job):
    """Random batches of (source, target) pairs, teacher-forced cross-entropy per target token (EOS included),
    greedy decoding of the held-out sources scored by corpus BLEU at each evaluation."""

    def __init__(self, model, tokenizer, train, test, pad_id: int, lr: float, warmup_steps: int, batch_size: int,
                 seed: int, scheduled_sampling: str | None = None):
        self.model, self.tokenizer, self.test, self.pad_id = model, tokenizer, test, pad_id
        self.scheduled = scheduled_sampling
        self.lr, self.warmup_steps, self.batch_size, self.seed = lr, warmup_steps, batch_size, seed
        self.src, self.tgt = encode_pairs(model, tokenizer, train)  # the labels `lmkit eval` scores the model on
        self.val = seq2seq_batch(*encode_pairs(model, tokenizer, test), pad_id)
        self.rng, self.result, self.objective = random.Random(seed), {}, PairsObjective()
        if scheduled_sampling:  # the decoder's inputs mixed with its own predictions (train/scheduled.py)
            self.objective = ScheduledSampling(scheduled_sampling, seq2seq=True, pad_id=pad_id,
                                               start_id=model.config.decoder_start_token_id)

    def build_optimizer(self) -> torch.optim.Optimizer:
        return build_optimizer(self.model, self.lr, weight_decay=0.01, betas=(0.9, 0.98))

    def warmup(self, total_steps: int | None) -> int:
        return self.warmup_steps

    def micro_batches(self, step: int, rank: int, world_size: int) -> list[dict[str, torch.Tensor]]:
        pick = [self.rng.randrange(len(self.src)) for _ in range(self.batch_size)]
        batch = seq2seq_batch([self.src[i] for i in pick], [self.tgt[i] for i in pick], self.pad_id)
        if self.scheduled:
            batch["teacher_forcing"] = torch.full((len(pick),), teacher_forcing_probability(self.scheduled, step))
        return [batch]

    def evaluate(self, precision: str) -> dict[str, float]:
        model, val = self.model, self.val
        model.eval()
        with torch.no_grad():
            logits = model(val["input_ids"], attention_mask=val["attention_mask"], labels=val["labels"]).logits
            val_loss = next_token_loss(logits, val["labels"]).mean.item()
        scores = evaluate_pairs(model, self.tokenizer, self.test)
        model.train()
        self.result = {"val_loss": val_loss, **scores}
        return {"loss": val_loss, **self.result}

    def step_row(self, loop, seconds: float, result: dict | None) -> dict:
        return {} if result is None else {k: v for k, v in result.items() if k != "loss"}

    def state(self) -> dict:
        version, internal, gauss = self.rng.getstate()
        return {"rng": [version, list(internal), gauss]}

    def load_state(self, state: dict) -> None:
        version, internal, gauss = state["rng"]
        self.rng.setstate((version, tuple(internal), gauss))


class PairsObjective:
    """Teacher-forced next-token loss of the target tokens."""

    def count(self, batch: dict[str, torch.Tensor]) -> int:
        return int((batch["labels"] != -100).sum())

    def loss(self, model, batch: dict[str, torch.Tensor]) -> tuple[LossSum, torch.Tensor | None]:
        output = model(batch["input_ids"], attention_mask=batch["attention_mask"], labels=batch["labels"])
        return next_token_loss(output.logits, batch["labels"]), getattr(output, "aux_loss", None)
