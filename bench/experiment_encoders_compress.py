"""DistilBERT and head pruning on a small BERT (issue 39), each step cached under $LMKIT_BENCH_DIR/enccomp.

    python bench/experiment_encoders_compress.py [--teacher-steps N | --teacher RUN] [--distill-steps N] [--seeds K]

1. Teacher: bert-tiny made 4 layers x 4 heads (d 128), masked-LM pre-training on 64-token rows of pydocs
   (`lmkit train --objective mlm`). Student: every other layer (2 x 4), trained by `lmkit distill`'s triple loss
   (alpha 2 CE + beta 5 T^2 KL at T 2 + gamma 1 cos) and, as the control, the same init and steps on the masked-LM
   labels alone (alpha 1, beta 0, gamma 0: the same code path, so the teacher's forward is in its time too).
   --teacher RUN takes an `lmkit train --objective mlm` folder instead (bench/experiment_encoders_pretrain.py's).
   Downstream: the six-topic classification of examples/pydocs_topics.py (266 training, 66 test paragraphs)
   fine-tuned from each (--seeds fine-tune seeds, their mean), and from a random init of the teacher's shape.
   Size, forward speed, masked-token accuracy, test accuracy.
2. Michel et al.'s head pruning of a fine-tuned classifier of the teacher's shape (--prune): heads ranked once
   by |dL/d gate| of the classification loss on the training paragraphs, the n least important removed (one kept
   per layer), no retraining; test accuracy against the fraction pruned, and against the same number of random
   heads (mean of 3 draws). Writes docs/img/encoder_prune_curve.png.
"""
from __future__ import annotations

import argparse
import json
import shutil
import sys
import time
from pathlib import Path

import torch

HERE = Path(__file__).resolve().parent
sys.path.insert(0, str(HERE))
sys.path.insert(0, str(HERE.parent / "examples"))
import compress_setup as setup  # noqa: E402
import machine  # noqa: E402
from bench_prune import forward_flops_per_token  # noqa: E402
from pydocs_topics import topic_examples  # noqa: E402

import lmkit  # noqa: E402
from lmkit.compress import DistillWeights  # noqa: E402
from lmkit.compress.encoders import classifier_loss, masked_lm_task, masked_scores  # noqa: E402
from lmkit.compress.prune import attention_modules, head_importance, least_important, prune_heads  # noqa: E402
from lmkit.compress.recipes import distill_folder, tokens_per_second  # noqa: E402
from lmkit.finetune import split_examples  # noqa: E402
from lmkit.finetune.classify import FinetuneConfig, finetune, predict  # noqa: E402
from lmkit.finetune.clm import CausalLMData  # noqa: E402
from lmkit.finetune.data import read_examples  # noqa: E402
from lmkit.finetune.metrics import accuracy  # noqa: E402

OUT = setup.BENCH_DIR / "enccomp"
SEQ = 64  # pre-training rows: the topic paragraphs are cut to 64 pieces too
TEACHER = {"n_layers": 4, "n_heads": 4}  # bert-tiny (d 128, d_ff 512) deeper, with heads of 32 dims
FINETUNE = dict(epochs=10, lr=1e-3, batch_size=16, max_length=64, progress=False, precision="fp32", seed=0)


def cpu_timed(fn):
    """(fn(), seconds of this process's CPU time)."""
    t = time.process_time()
    return fn(), time.process_time() - t


def teacher(steps: int) -> Path:
    out = OUT / f"bert-teacher-{steps}"
    if not (out / "model.safetensors").exists():
        from lmkit.train import TrainConfig, Trainer

        cfg = TrainConfig(preset="bert-tiny", objective="mlm", corpus=["pydocs"], out=str(out), max_steps=steps,
                          batch_size=16, seq_len=SEQ, precision="fp32", progress=False, model_overrides=TEACHER,
                          lr=2e-3, warmup_steps=40, seed=0, save_every=steps, eval_every=steps)
        _, cpu = cpu_timed(Trainer(cfg).fit)
        (out / "bench_cpu.json").write_text(json.dumps({"cpu_s": cpu}))
    return out


def topics() -> tuple[Path, Path]:
    """train.jsonl and test.jsonl of examples/pydocs_topics.py (the same seeded split)."""
    train, test = split_examples(topic_examples(), 0.2, seed=0)
    OUT.mkdir(parents=True, exist_ok=True)
    paths = OUT / "topics-train.jsonl", OUT / "topics-test.jsonl"
    for path, rows in zip(paths, (train, test)):
        path.write_text("".join(json.dumps({"text": e.text, "label": e.label}) + "\n" for e in rows))
    return paths


def random_init(like: Path) -> Path:
    """A folder of `like`'s shape and tokenizer with fresh random weights (the no-pre-training row), beside it."""
    out = like.parent / f"bert-random-{like.name}"
    if not (out / "model.safetensors").exists():
        torch.manual_seed(0)
        model = lmkit.load_model(like)
        type(model)(model.config).save_pretrained(out)
        for name in ("tokenizer.json", "tokenizer_config.json", "special_tokens_map.json"):
            if (like / name).exists():
                shutil.copy(like / name, out / name)
    return out


def classify(folder: Path, data: tuple[Path, Path], seed: int = 0) -> dict:
    """Fine-tune on the topics (cached beside the model folder); the last epoch's test accuracy (no selection on
    the test set)."""
    out = folder.parent / (f"clf-{folder.name}-e{FINETUNE['epochs']}" + ("" if seed == 0 else f"-s{seed}"))
    if not (out / "finetune.json").exists():
        finetune(FinetuneConfig(model=str(folder), train=str(data[0]), eval=str(data[1]), out=str(out),
                                **{**FINETUNE, "seed": seed}))
    rows = [json.loads(line) for line in (out / "metrics.jsonl").read_text().splitlines() if line.strip()]
    last = [r for r in rows if "accuracy" in r or "eval_accuracy" in r][-1]
    return {"accuracy": last.get("eval_accuracy", last.get("accuracy")), "folder": out}


def classify_seeds(folder: Path, data: tuple[Path, Path], seeds: int) -> dict:
    """`classify` for seeds 0..seeds-1: the mean accuracy, each seed's, and seed 0's folder."""
    runs = [classify(folder, data, seed) for seed in range(seeds)]
    accs = [r["accuracy"] for r in runs]
    return {"accuracy": sum(accs) / len(accs), "per_seed": accs, "folder": runs[0]["folder"]}


def train_cpu(folder: Path) -> float | None:
    """CPU seconds a bench recorded for training this folder (this bench's bench_cpu.json, or the pre-training
    bench's run.json)."""
    for name in ("bench_cpu.json", "run.json"):
        if (folder / name).exists():
            return json.loads((folder / name).read_text()).get("cpu_s")
    return None


def distil_table(args, data) -> list[dict]:
    tdir = Path(args.teacher) if args.teacher else teacher(args.teacher_steps)
    runs = {"distilled": DistillWeights(), "labels only": DistillWeights(alpha=1.0, beta=0.0, gamma=0.0)}
    folders = {"teacher": tdir, "random init": random_init(tdir)}
    seconds = {"teacher": train_cpu(tdir)}
    for name, weights in runs.items():
        out = tdir.parent / f"student-{tdir.name}-{name.replace(' ', '-')}-{args.distill_steps}"
        if not (out / "distill.json").exists():
            _, cpu = cpu_timed(lambda: distill_folder(tdir, out, steps=args.distill_steps, batch_size=16, seq_len=SEQ,
                                                      lr=1e-3, weights=weights, max_val_docs=60, precision="fp32"))
            (out / "bench_cpu.json").write_text(json.dumps({"cpu_s": cpu}))
        folders[name], seconds[name] = out, json.loads((out / "bench_cpu.json").read_text())["cpu_s"]
    tok = lmkit.load_tokenizer(tdir / "tokenizer.json")
    mlm = CausalLMData(tok, ["pydocs"], SEQ, 60)
    probe = mlm.val_rows[:16, :SEQ]
    models = {name: lmkit.load_model(folder).eval() for name, folder in folders.items()}
    speed = {name: 0.0 for name in folders}
    with torch.no_grad():  # rounds interleaved, best of each: the shared machine's load moves between them
        for _ in range(3):
            for name in ("teacher", "distilled"):
                speed[name] = max(speed[name], tokens_per_second(models[name], probe, repeats=3))
    speed["random init"], speed["labels only"] = speed["teacher"], speed["distilled"]  # the same shapes
    rows = []
    for name, folder in folders.items():
        model = models[name]
        with torch.no_grad():
            masked = masked_scores(masked_lm_task(model, tok), model, mlm)
        rows.append({"model": name, "layers": model.config.n_layers, "params": model.num_parameters(),
                     "speed": speed[name], "mflops": forward_flops_per_token(model, SEQ) / 1e6,
                     "masked_accuracy": masked["masked_accuracy"],
                     "masked_loss": masked["masked_loss"], "train_cpu_s": seconds.get(name),
                     **{f"topics_{k}": v for k, v in classify_seeds(folder, data, args.seeds).items()}})
        print(rows[-1], flush=True)
    return rows


def prune_curve(data, folder: Path, repeats: int = 3) -> list[dict]:
    """Test accuracy of the classifier in `folder` with 0, 2, 4, ... heads pruned (see the module docstring)."""
    tok = lmkit.load_tokenizer(folder / "tokenizer.json")
    model = lmkit.load_model(folder)
    train, test = read_examples(str(data[0])), read_examples(str(data[1]))
    labels = {n: int(i) for i, n in model.config.extra["id2label"].items()}
    gold = [labels[e.label] for e in test]
    parts = [train[i:i + 8] for i in range(0, len(train), 8)]
    importance = head_importance(model, parts, loss_fn=classifier_loss(tok, labels, FINETUNE["max_length"]))
    total = sum(len(v) for v in importance.values())

    def pruned_accuracy(scores, n: int) -> float:
        m = lmkit.load_model(folder)
        if n:
            prune_heads(m, least_important(scores, n, m))
        return accuracy(predict(m, tok, test, labels, max_length=FINETUNE["max_length"]), gold)

    rows = []
    for n in range(0, total - len(importance) + 1, 2):
        g = torch.Generator().manual_seed(0)
        rand = [pruned_accuracy({k: torch.rand(len(v), generator=g) for k, v in importance.items()}, n)
                for _ in range(repeats if n else 1)]
        m = lmkit.load_model(folder)
        if n:
            prune_heads(m, least_important(importance, n, m))
        rows.append({"pruned": n, "total": total, "fraction": n / total, "accuracy": pruned_accuracy(importance, n),
                     "random": sum(rand) / len(rand), "params": m.num_parameters(),
                     "heads_left": sum(a.n_heads for a in attention_modules(m).values())})
        print(rows[-1], flush=True)
    return rows


def plot(rows: list[dict], path: Path) -> None:
    import matplotlib

    matplotlib.use("Agg")
    from matplotlib.figure import Figure

    fig = Figure(figsize=(6, 4))
    ax = fig.add_subplot(1, 1, 1)
    x = [100 * r["fraction"] for r in rows]
    ax.plot(x, [r["accuracy"] for r in rows], "o-", label="least important first (Michel et al.)")
    ax.plot(x, [r["random"] for r in rows], "s--", label="random heads (mean of 3)")
    ax.axhline(1 / 6, color="grey", lw=0.8, ls=":", label="chance (6 topics)")
    ax.set_xlabel(f"% of attention heads pruned (of {rows[0]['total']}, no retraining)")
    ax.set_ylabel("topic accuracy (66 test paragraphs)")
    ax.legend()
    ax.grid(alpha=0.3)
    fig.tight_layout()
    fig.savefig(path)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--teacher-steps", type=int, default=400, metavar="N", help="teacher pre-training steps (400)")
    ap.add_argument("--teacher", metavar="RUN", help="an `lmkit train --objective mlm` folder to use as the teacher "
                                                     "instead of training one (default: train one)")
    ap.add_argument("--distill-steps", type=int, default=150, metavar="N", help="student training steps (150)")
    ap.add_argument("--seeds", type=int, default=1, metavar="K", help="topic fine-tune seeds per model (1)")
    ap.add_argument("--prune", default="random init", choices=["teacher", "random init"], metavar="MODEL",
                    help="whose fine-tuned classifier part 2 prunes: teacher or 'random init' (random init: at "
                         "this budget the masked-LM teacher stays on a plateau (masked accuracy 0.083) and its "
                         "classifier at the majority class, which no head changes)")
    args = ap.parse_args()
    torch.manual_seed(0)
    OUT.mkdir(parents=True, exist_ok=True)
    data = topics()
    rows = distil_table(args, data)
    base = rows[0]
    for r in rows:
        r["params_s"], r["speed_s"] = f"{r['params']:,}", f"{r['speed']:,.0f} ({r['speed'] / base['speed']:.2f}x)"
        r["flops_s"] = f"{r['mflops']:.2f} ({r['mflops'] / base['mflops']:.2f}x)"
        r["mlm_s"] = f"{r['masked_accuracy']:.3f} ({100 * r['masked_accuracy'] / base['masked_accuracy']:.0f}%)"
        r["clf_s"] = f"{r['topics_accuracy']:.3f} ({100 * r['topics_accuracy'] / base['topics_accuracy']:.0f}%)"
        r["seeds_s"] = ", ".join(f"{a:.3f}" for a in r["topics_per_seed"])
        r["loss_s"] = f"{r['masked_loss']:.3f}"
        r["cpu_s"] = "-" if r["train_cpu_s"] is None else f"{r['train_cpu_s']:.0f} s"
    print(f"\nteacher {args.teacher or args.teacher_steps} steps, students {args.distill_steps} steps, "
          f"batch 16 x {SEQ} of pydocs\n")
    print(machine.describe(["fp32"]))
    print(setup.table(rows, [("model", "model"), ("layers", "layers"), ("params_s", "parameters"),
                             ("flops_s", "forward MFLOPs/token"), ("speed_s", "forward tokens/s (noisy)"),
                             ("loss_s", "masked loss"),
                             ("mlm_s", "masked acc. (vs teacher)"), ("clf_s", "topic acc. (vs teacher)"),
                             ("seeds_s", "topic acc. per seed"),
                             ("cpu_s", "train CPU")]))
    curve = prune_curve(data, next(r["topics_folder"] for r in rows if r["model"] == args.prune))
    for r in curve:
        r["frac_s"], r["acc_s"] = f"{100 * r['fraction']:.1f}%", f"{r['accuracy']:.3f}"
        r["rand_s"] = f"{r['random']:.3f}"
        r["params_s"] = f"{r['params']:,}"
    print(setup.table(curve, [("pruned", "heads pruned"), ("frac_s", "fraction"), ("heads_left", "heads left"),
                              ("params_s", "parameters"), ("acc_s", "test acc., least important first"),
                              ("rand_s", "test acc., random heads")]))
    name = Path(args.teacher).name if args.teacher else args.teacher_steps
    (OUT / f"results-{name}.json").write_text(json.dumps({"distil": rows, "prune": curve}, default=str, indent=1))
    plot(curve, HERE.parent / "docs" / "img" / "encoder_prune_curve.png")


if __name__ == "__main__":
    main()
