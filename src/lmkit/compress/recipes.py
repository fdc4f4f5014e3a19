"""End-to-end compression jobs on model folders (what `lmkit distill`, `lmkit prune` and
`lmkit quantize` run): load, compress, evaluate on a corpus's validation split, save, report."""
from __future__ import annotations

import time

import torch

from lmkit.compress.distill import DistillWeights, distill_causal_lm, student_from_teacher
from lmkit.compress.prune import attention_modules, head_importance, least_important, prune_heads
from lmkit.compress.quantize import quantize_dynamic_int8, weight_bytes
from lmkit.errors import ConfigError
from lmkit.peft.finetune import causal_lm_data, check_out, model_folder, save_model_folder


def distill_folder(teacher_dir, out, corpus=("pydocs",), steps: int = 200, batch_size: int = 16,
                   seq_len: int | None = None, lr: float = 1e-3, every: int = 2, weights: DistillWeights | None = None,
                   seed: int = 0, max_val_docs: int | None = None, log=None, device=None) -> dict:
    """Student = every other teacher layer, trained against the teacher on `device` (None: the CPU); saved to
    `out` with metrics."""
    check_out(out, teacher_dir, "--teacher")
    teacher, tok = model_folder(teacher_dir, device)
    data = causal_lm_data(teacher, tok, corpus, seq_len, max_val_docs)
    student = student_from_teacher(teacher, every)
    history = distill_causal_lm(teacher, student, data.stream, data.pad, steps, batch_size, lr,
                                warmup_steps=min(50, steps // 10), weights=weights, seed=seed, log=log)
    t, s = data.evaluate(teacher), data.evaluate(student)
    report = {"teacher": {"layers": teacher.config.n_layers, "parameters": teacher.num_parameters(), **t},
              "student": {"layers": student.config.n_layers, "parameters": student.num_parameters(), **s},
              "steps": steps, "seconds": history[-1]["elapsed"] if history else 0.0}
    save_model_folder(student, tok, out, {"distill.json": report, "metrics.jsonl": history})
    return report


def prune_folder(model_dir, out, heads: int, corpus=("pydocs",), batches: int = 8, batch_size: int = 8,
                 seq_len: int | None = None, max_val_docs: int | None = None, device=None) -> dict:
    """Prune the `heads` least important heads (importance from `batches` training batches, on `device`; None:
    the CPU); save to `out`."""
    if batches < 1:
        raise ConfigError(f"--batches must be at least 1 (importance needs data), got {batches}")
    check_out(out, model_dir)
    model, tok = model_folder(model_dir, device)
    data = causal_lm_data(model, tok, corpus, seq_len, max_val_docs)
    before = data.evaluate(model)
    n_params = model.num_parameters()
    rows = [data.stream.rows(1234, i, batch_size) for i in range(batches)]
    importance = head_importance(model, rows)
    chosen = least_important(importance, heads, model)
    prune_heads(model, chosen)
    after = data.evaluate(model)
    report = {"pruned": {k: sorted(v) for k, v in chosen.items()}, "heads_pruned": sum(map(len, chosen.values())),
              "parameters_before": n_params, "parameters_after": model.num_parameters(), "before": before, "after": after}
    save_model_folder(model, tok, out, {"prune.json": report})
    return report


def forward_flops_per_token(model, context: int) -> float:
    """Multiply-adds x 2 of one token's forward pass at a given context length: 2 per weight of every
    linear layer, plus 4 * context * head_dim per attention head (scores q k^T and the sum over v)."""
    linear = sum(m.in_features * m.out_features for m in model.modules() if isinstance(m, torch.nn.Linear))
    heads = sum(a.n_heads * a.head_dim for a in attention_modules(model).values())
    return 2.0 * linear + 4.0 * context * heads


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
