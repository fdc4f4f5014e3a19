"""Train a small T5-style model on a task of (source, target) pairs and score it by corpus BLEU.

The loop reuses the trainer's pieces (AdamW groups, warm-up + cosine schedule, metrics.jsonl,
the loss-curve plot) for pair data, which the packed-stream trainer does not read: each step
draws a batch of pairs, the loss is teacher-forced cross-entropy per target token (EOS included),
and every `eval_every` steps the held-out sources are decoded greedily and scored with sacrebleu.
"""
from __future__ import annotations

import random
import time
from pathlib import Path
from typing import Any

import torch

from lmkit.atomic import atomic_save_file, atomic_write_json
from lmkit.config import get_preset
from lmkit.evaluate.seq2seq import encode_pairs, evaluate_pairs
from lmkit.models import build_model
from lmkit.objectives import next_token_loss, seq2seq_batch, with_aux_loss
from lmkit.train.metrics import MetricsLog, plot_losses
from lmkit.train.optim import build_optimizer, lr_at, set_lr


def fit_pairs(train: list[tuple[str, str]], test: list[tuple[str, str]], tokenizer, out: str | Path,
              preset: str = "t5-tiny", steps: int = 3000, time_budget: float | None = None, batch_size: int = 64,
              lr: float = 1e-3, warmup_steps: int = 100, eval_every: int = 500, seed: int = 0,
              log_every: int = 50, task: str | None = None, **overrides: Any) -> dict[str, Any]:
    """Train `preset` on `train` pairs for `steps` (or until `time_budget` seconds); returns the last scores.

    out/ gets the model folder (config.json, model.safetensors, tokenizer.json), metrics.jsonl with
    `step`, `loss`, and on evaluation steps `val_loss`, `bleu`, ROUGE and exact match, and loss_curve.png;
    with `task` (a built-in task's name), task.json, so that `lmkit eval --model out` scores that task.
    Targets are labeled as `lmkit eval` labels references (`encode_pairs`): tokens + EOS, and for an mBART-style
    model (overrides decoder_start_from_labels=True, decoder_start_token_id=the target language code) `X </s> code`.
    """
    out = Path(out)
    out.mkdir(parents=True, exist_ok=True)
    torch.manual_seed(seed)
    rng = random.Random(seed)
    specials = {k: tokenizer.token_to_id(v) for k, v in (("pad", "<pad>"), ("eos", "</s>"))}
    settings = {"decoder_start_token_id": specials["pad"], **overrides}  # T5 starts from pad, mBART from a code
    config = get_preset(preset, vocab_size=tokenizer.vocab_size, pad_token_id=specials["pad"],
                        eos_token_id=specials["eos"], **settings)
    model = build_model(config)
    model.train()
    optimizer = build_optimizer(model, lr, weight_decay=0.01, betas=(0.9, 0.98))
    src, tgt = encode_pairs(model, tokenizer, train)  # the labels `lmkit eval` scores the model on
    val = seq2seq_batch(*encode_pairs(model, tokenizer, test), specials["pad"])
    metrics = MetricsLog(out / "metrics.jsonl")
    metrics.reset()
    t0, step, result = time.perf_counter(), 0, {}

    def evaluate() -> dict[str, float]:
        model.eval()
        with torch.no_grad():
            logits = model(val["input_ids"], attention_mask=val["attention_mask"], labels=val["labels"]).logits
            val_loss = next_token_loss(logits, val["labels"]).mean.item()
        scores = evaluate_pairs(model, tokenizer, test)
        model.train()
        return {"val_loss": val_loss, **scores}

    while step < steps and (time_budget is None or time.perf_counter() - t0 < time_budget):
        set_lr(optimizer, lr_at(step, lr, warmup_steps, steps, lr * 0.05))
        pick = [rng.randrange(len(src)) for _ in range(batch_size)]
        batch = seq2seq_batch([src[i] for i in pick], [tgt[i] for i in pick], specials["pad"])
        output = model(batch["input_ids"], attention_mask=batch["attention_mask"], labels=batch["labels"])
        loss = next_token_loss(output.logits, batch["labels"]).mean
        with_aux_loss(loss, getattr(output, "aux_loss", None), model.config.router_aux_loss_coef).backward()
        torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0)
        optimizer.step()
        optimizer.zero_grad(set_to_none=True)
        step += 1
        row: dict[str, Any] = {"step": step, "loss": loss.item(), "elapsed": round(time.perf_counter() - t0, 2)}
        last = step >= steps or (time_budget is not None and time.perf_counter() - t0 >= time_budget)
        if step % eval_every == 0 or last:
            result = evaluate()
            row.update(result)
        if step % log_every == 0 or "bleu" in row:
            metrics.append(row)
    model.eval()
    model.save_pretrained(out)
    atomic_save_file(out / "tokenizer.json", lambda tmp: tokenizer.save(tmp))
    if task is not None:  # `lmkit eval --model out` then scores the task's held-out set
        atomic_write_json(out / "task.json", {"task": task}, sort_keys=True)
    plot_losses(metrics.read(), out / "loss_curve.png", title=f"{preset} on numbers-to-words")
    return {"step": step, "elapsed": time.perf_counter() - t0, **result}
