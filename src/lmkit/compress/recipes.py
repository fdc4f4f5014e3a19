"""End-to-end compression jobs on model folders (what `lmkit distill`, `lmkit prune` and
`lmkit quantize` run): load, compress, evaluate on a corpus's validation split, save, report."""
from __future__ import annotations

import time

import torch

from lmkit.compress.distill import DistillationObjective, DistillWeights, student_from_teacher
from lmkit.compress.encoders import MaskedDistillation, masked_lm_task, masked_scores, prune_classifier
from lmkit.compress.prune import head_importance, least_important, prune_heads
from lmkit.compress.quantize import quantize_dynamic_int8, weight_bytes
from lmkit.compress.sparsity import (GradualPruning, apply_masks, check_sparsity, magnitude_masks, prunable,
                                     sparse_speed, sparsity_report)
from lmkit.errors import ConfigError
from lmkit.finetune.clm import causal_lm_data, train_causal_lm
from lmkit.finetune.common import check_out, check_run, model_folder, save_model_folder
from lmkit.progress import progress_bar
from lmkit.train import distributed


def distill_folder(teacher_dir, out, corpus=("pydocs",), steps: int = 200, batch_size: int = 16,
                   seq_len: int | None = None, lr: float = 1e-3, every: int = 2, weights: DistillWeights | None = None,
                   seed: int = 0, max_val_docs: int | None = None, log=None, precision: str | None = None,
                   lr_schedule: str = "cosine", save_every: int | None = None, resume: bool = False,
                   device=None) -> dict:
    """Student = every other teacher layer, trained against the teacher; saved to `out` with metrics.jsonl (as
    training goes; with `save_every`, checkpoints that `resume` continues from); on `device` (None: the CPU)."""
    check_out(out, teacher_dir, "--teacher")
    precision = check_run(out, resume, save_every, precision, lr_schedule)
    teacher, tok = model_folder(teacher_dir, device, encoders=True)
    data = causal_lm_data(teacher, tok, corpus, seq_len, max_val_docs)
    task = masked_lm_task(teacher, tok) if teacher.config.architecture == "encoder" else None
    student = student_from_teacher(teacher, every)
    objective = MaskedDistillation(teacher, task, weights) if task else DistillationObjective(teacher, weights)
    history = train_causal_lm(student, data.stream, data.pad, steps, batch_size, lr, min(50, steps // 10), seed, 0.1,
                              1.0, objective, log, out=out, precision=precision, lr_schedule=lr_schedule,
                              save_every=save_every, resume=resume)
    score = (lambda m: masked_scores(task, m, data)) if task else data.evaluate
    t, s = score(teacher), score(student)
    report = {"teacher": {"layers": teacher.config.n_layers, "parameters": teacher.num_parameters(), **t},
              "student": {"layers": student.config.n_layers, "parameters": student.num_parameters(), **s},
              "steps": steps, "seconds": history[-1]["elapsed"] if history else 0.0, "precision": precision}
    if distributed.setup().is_main:  # under torchrun rank 0 writes
        save_model_folder(student, tok, out, {"distill.json": report})
    return report


def _scored(model_dir, out, corpus, seq_len, max_val_docs, device, stage):
    """(model, tokenizer, data, validation scores) of the folder a compression job starts from."""
    check_out(out, model_dir)
    model, tok = model_folder(model_dir, device)
    data = causal_lm_data(model, tok, corpus, seq_len, max_val_docs)
    stage(f"scoring the model on the validation split ({len(data.val_rows)} rows)")
    return model, tok, data, data.evaluate(model)


def prune_folder(model_dir, out, heads: int, corpus=("pydocs",), batches: int = 8, batch_size: int = 8,
                 seq_len: int | None = None, max_val_docs: int | None = None, progress: bool = False,
                 stage=None, device=None, data_file: str | None = None) -> dict:
    """Prune the `heads` least important heads (importance from `batches` training batches, on `device`;
    None: the CPU); save to `out`. An encoder classifier: importance and accuracy from `data_file`'s labelled rows.
    stage(text) hears each step as it starts; progress draws a bar over the importance batches (a terminal only)."""
    stage = stage or (lambda text: None)
    if batches < 1:
        raise ConfigError(f"--batches must be at least 1 (importance needs data), got {batches}")
    check_out(out, model_dir)
    model, tok = model_folder(model_dir, device, encoders=True)
    if model.config.architecture == "encoder":  # a fine-tuned classifier, scored on labelled rows
        if data_file is None:
            raise ConfigError("an encoder's heads are pruned by a classifier's loss: pass --data FILE (CSV or JSONL "
                              "rows with text and label, as `lmkit finetune` reads them)")
        stage(f"head importance from {batches} batches of {data_file}")
        report = prune_classifier(model, tok, heads, data_file, batches, batch_size,
                                  progress=lambda parts: progress_bar(progress, iterable=parts, desc="importance",
                                                                      unit="batch"))
        save_model_folder(model, tok, out, {"prune.json": report})
        return report
    if data_file is not None:
        raise ConfigError("--data holds a classifier's labelled rows; a causal LM is pruned by its loss on --corpus")
    data = causal_lm_data(model, tok, corpus, seq_len, max_val_docs)
    stage(f"scoring the model on the validation split ({len(data.val_rows)} rows)")
    before = data.evaluate(model)
    n_params = model.num_parameters()
    rows = [data.stream.rows(1234, i, batch_size) for i in range(batches)]
    stage(f"head importance from {batches} batches")
    importance = head_importance(model, progress_bar(progress, iterable=rows, desc="importance", unit="batch"))
    chosen = least_important(importance, heads, model)
    prune_heads(model, chosen)
    stage("scoring the pruned model")
    after = data.evaluate(model)
    report = {"pruned": {k: sorted(v) for k, v in chosen.items()}, "heads_pruned": sum(map(len, chosen.values())),
              "parameters_before": n_params, "parameters_after": model.num_parameters(), "before": before, "after": after}
    save_model_folder(model, tok, out, {"prune.json": report})
    return report


def sparsify_folder(model_dir, out, sparsity: float, scope: str = "global", steps: int = 0, corpus=("pydocs",),
                    batch_size: int = 8, lr: float = 1e-4, seq_len: int | None = None, max_val_docs: int | None = None,
                    seed: int = 0, stage=None, device=None) -> dict:
    """Zero the `sparsity` fraction of smallest-magnitude weights (`sparsity.py`): at once (steps=0), or gradually
    over `steps` fine-tuning steps on `corpus` along the cubic schedule (reached at three quarters of the run).
    Saved dense with zeros to `out`, with prune.json: scores before and after, sparsities, dense vs CSR time."""
    stage = stage or (lambda text: None)
    check_sparsity(sparsity)
    if not isinstance(steps, int) or steps < 0:
        raise ConfigError(f"--gradual-steps must be 0 (prune at once) or a positive number of steps, got {steps}")
    model, tok, data, before = _scored(model_dir, out, corpus, seq_len, max_val_docs, device, stage)
    if steps == 0:
        apply_masks(model, magnitude_masks(model, sparsity, scope))
    else:
        end = (3 * (steps - 1)) // 4
        stage(f"fine-tuning {steps} steps while pruning to {sparsity:.0%} (cubic schedule, reached at step {end + 1})")
        train_causal_lm(model, data.stream, data.pad, steps, batch_size, lr, warmup_steps=0, seed=seed,
                        pruning=GradualPruning(sparsity, 0, end, max(1, end // 8), scope))
    stage("scoring the pruned model")
    after = data.evaluate(model)
    widest = max(prunable(model).values(), key=lambda w: w.numel()).detach().float().cpu()
    report = {"method": "magnitude", "scope": scope, "target_sparsity": sparsity, "gradual_steps": steps,
              **sparsity_report(model), "before": before, "after": after, "matmul_seconds": sparse_speed(widest)}
    save_model_folder(model, tok, out, {"prune.json": report})
    return report


@torch.no_grad()
def tokens_per_second(model, rows: torch.Tensor, repeats: int = 3) -> float:
    """Forward-pass throughput over `rows` (best of `repeats`)."""
    best = float("inf")
    model(rows[:1, :8])  # warm-up
    for _ in range(repeats):
        t = time.perf_counter()
        model(rows)
        best = min(best, time.perf_counter() - t)
    return rows.numel() / best


def quantize_report(model_dir, corpus=("pydocs",), seq_len: int | None = None, max_val_docs: int | None = 100,
                    batch: int = 8, out_dir=None) -> dict:
    """fp32 against dynamic int8: weight bytes, forward tokens/s on CPU and validation loss; the int8 model
    (safetensors, lmkit's format) and the report are written to `out_dir` when given."""
    check_out(out_dir, model_dir)
    model, tok = model_folder(model_dir)
    data = causal_lm_data(model, tok, corpus, seq_len, max_val_docs)
    q = quantize_dynamic_int8(model)
    rows = data.val_rows[:batch, :-1]
    out = {}
    for name, m in (("fp32", model), ("int8", q)):
        r = data.evaluate(m)
        out[name] = {"bytes": weight_bytes(m), "tokens_per_s": tokens_per_second(m, rows), "loss": r["loss"],
                     "perplexity": r["perplexity"], "accuracy": r["accuracy"]}
    if out_dir is not None:
        save_model_folder(q, tok, out_dir, {"quantize.json": out})
    return out
