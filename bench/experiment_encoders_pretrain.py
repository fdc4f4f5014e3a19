"""Issue 39's pre-training comparisons at small scale, each at the same steps, batch and sequence length:

- nsp: bert-tiny (--layers x --heads) pre-trained with `--objective mlm` and with `--objective mlm-nsp` (RoBERTa's
  ablation), then the same fine-tune on a sentence-pair task made from the corpus: are two reference paragraphs of
  the same pydocs topic? (pairs of six topics' paragraphs, 50/50, test paragraphs never in training pairs), for
  --seeds fine-tune seeds, a linear probe on pair features, and the six-topic single-paragraph classification of
  bench/experiment_encoders_compress.py (its fine-tune, --seeds seeds); the same shape from random weights too.
- noise: t5-tiny (what `lmkit train --objective denoise` picks) pre-trained with each of BART's five noisings
  and the paper's infilling,permutation, plus an untrained model; each then fine-tuned the same steps on the
  numbers-to-words task (`lmkit.data.translation`); its own reconstruction loss, the downstream loss and BLEU.
- efficiency: a causal LM and a masked LM of one size (2 layers x 128, the bert-tiny shape; GPT-2 blocks for the
  CLM) trained on the same rows; at checkpoints, each one's own validation loss and a common measure: a linear
  probe (logistic regression, mean-pooled last hidden states) on the six-topic paragraph classification.

    nice -n 19 python bench/experiment_encoders_pretrain.py --part nsp|noise|efficiency [--steps N] [--out DIR]
        [--layers L --heads H --lr LR --warmup N --eval-every N]   (nsp: the models' shape and recipe)

Prints each table and writes OUT/PART.md; CPU seconds (this process) per run are in the tables.
"""
from __future__ import annotations

import argparse
import json
import random
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "examples"))
sys.path.insert(0, str(Path(__file__).resolve().parent))

TOPIC_SPLIT = 0.2
NOISES = ("masking", "deletion", "infilling", "permutation", "rotation", "infilling,permutation")


def cpu() -> float:
    return time.process_time()


BATCH, SEQ = 16, 64  # set from --batch-size / --seq-len


def pretrain(out: Path, steps: int, **settings) -> dict:
    """One `lmkit train` run through the library (its result, and the CPU seconds it took), cached in out/run.json."""
    from lmkit.train import TrainConfig, train

    done = out / "run.json"
    if not done.is_file():
        settings = {"save_every": steps, "eval_every": steps, **settings}  # one evaluation at the end, by default
        start = cpu()
        result = train(TrainConfig(out=str(out), max_steps=steps, batch_size=BATCH, seq_len=SEQ,
                                   precision="fp32", seed=0, progress=False, **settings))
        result["cpu_s"] = cpu() - start
        done.write_text(json.dumps(result))
    return json.loads(done.read_text())


def topic_split():
    from pydocs_topics import topic_examples

    from lmkit.finetune import split_examples

    return split_examples(topic_examples(), TOPIC_SPLIT, seed=0)


def same_topic_pairs(examples, n: int, seed: int) -> list[dict]:
    """n rows {text, text_pair, label}: half two paragraphs of one topic ("same"), half of two topics ("different")."""
    rng = random.Random(seed)
    by_topic: dict[str, list] = {}
    for e in examples:
        by_topic.setdefault(e.label, []).append(e.text)
    topics = sorted(by_topic)
    rows = []
    for i in range(n):
        a_topic = rng.choice(topics)
        same = i % 2 == 0
        b_topic = a_topic if same else rng.choice([t for t in topics if t != a_topic])
        a, b = rng.choice(by_topic[a_topic]), rng.choice(by_topic[b_topic])
        rows.append({"text": a, "text_pair": b, "label": "same" if same else "different"})
    return rows


def write_jsonl(path: Path, rows: list[dict]) -> Path:
    path.write_text("".join(json.dumps(r) + "\n" for r in rows), encoding="utf-8")
    return path


def pair_probe(run: Path, train_rows: list[dict], test_rows: list[dict]) -> float:
    """Linear-probe accuracy on the pair task from frozen features: (u, v, |u - v|, u * v) of the two paragraphs'
    mean-pooled states (InferSent's pair features)."""
    import torch

    from lmkit.hub import load_model
    from lmkit.tokenizers import load_tokenizer

    model, tok = load_model(run), load_tokenizer(run / "tokenizer.json")
    model.eval()
    texts = sorted({r[k] for r in train_rows + test_rows for k in ("text", "text_pair")})
    table = dict(zip(texts, features(model, tok, texts, SEQ)))

    def pairs(rows):
        u, v = torch.stack([table[r["text"]] for r in rows]), torch.stack([table[r["text_pair"]] for r in rows])
        return torch.cat([u, v, (u - v).abs(), u * v], 1).numpy(), [r["label"] for r in rows]

    return probe(*pairs(train_rows), *pairs(test_rows))


def part_nsp(out: Path, steps: int, seeds: int, recipe: dict) -> str:
    from experiment_encoders_compress import classify_seeds, random_init, topics

    from lmkit.finetune import FinetuneConfig, finetune

    train_ex, test_ex = topic_split()
    train_rows, test_rows = same_topic_pairs(train_ex, 320, seed=1), same_topic_pairs(test_ex, 200, seed=2)
    train_file = write_jsonl(out / "pairs-train.jsonl", train_rows)
    test_file = write_jsonl(out / "pairs-test.jsonl", test_rows)
    lines = ["| pre-training | steps | masked acc (val) | NSP acc (val) | pre-train CPU s | "
             "same-topic pairs: fine-tuned acc, last epoch (per seed) | same-topic pairs: linear probe acc | "
             "topics: fine-tuned acc (per seed) |", "|---|---|---|---|---|---|---|---|"]
    for objective in ("mlm", "mlm-nsp", "none"):
        if objective == "none":  # the same shape and tokenizer from random weights
            run, r = random_init(out / "mlm"), {}
        else:
            run = out / objective
            r = pretrain(run, steps, preset="bert-tiny", objective=objective, **recipe)
        accs = []
        for seed in range(seeds):
            ft = out / f"{objective}-pairs-{seed}"
            done = ft / "best.json"
            if not done.is_file():
                best = finetune(FinetuneConfig(model=str(run), train=str(train_file), eval=str(test_file),
                                               out=str(ft), epochs=4, lr=5e-4, batch_size=16, max_length=SEQ,
                                               seed=seed, progress=False, precision="fp32"))
                done.write_text(json.dumps(best))
            accs.append(last_epoch_accuracy(ft))
        probed = pair_probe(run, train_rows, test_rows)
        clf = classify_seeds(run, topics(), seeds)
        nsp, masked = r.get("val_nsp_accuracy"), r.get("val_masked_accuracy")
        lines.append(f"| {objective} | {r.get('step', 0)} | {'-' if masked is None else f'{masked:.3f}'} | "
                     f"{'-' if nsp is None else f'{nsp:.3f}'} | {r.get('cpu_s', 0):.0f} | "
                     f"{mean_and_seeds(accs)} | {probed:.3f} | {mean_and_seeds(clf['per_seed'])} |")
        print(lines[-1], flush=True)
    return "\n".join(lines)


def last_epoch_accuracy(run: Path) -> float:
    """The last epoch's test accuracy of a fine-tune (no selection on the test set)."""
    rows = [json.loads(line) for line in (run / "metrics.jsonl").read_text().splitlines() if line.strip()]
    return [r for r in rows if "accuracy" in r][-1]["accuracy"]


def mean_and_seeds(accs: list[float]) -> str:
    return f"**{sum(accs) / len(accs):.3f}** ({', '.join(f'{a:.3f}' for a in accs)})"


def part_noise(out: Path, steps: int, ft_steps: int) -> str:
    from lmkit.data.translation import make_pairs
    from lmkit.evaluate.seq2seq import evaluate_pairs
    import torch

    from lmkit.hub import load_model
    from lmkit.models import build_model
    from lmkit.tokenizers import load_tokenizer
    from lmkit.train.loop import LoopSettings, TrainLoop
    from lmkit.train.translation import PairsJob

    train_pairs, test_pairs = make_pairs(n_train=5000, n_test=200, seed=0)
    lines = ["| noising | own reconstruction loss (val) | pre-train CPU s | numbers: val loss | numbers: BLEU | "
             "numbers: exact match |", "|---|---|---|---|---|---|"]
    for noise in NOISES + ("none (no pre-training)",):
        if noise.startswith("none"):  # the same model and tokenizer, fresh weights
            run, r = out / "none", {}
            run.mkdir(exist_ok=True)
        else:
            run = out / noise.replace(",", "+")
            r = pretrain(run, steps, preset="t5-tiny", objective="denoise", noise=noise)
        done = run / "downstream.json"
        if not done.is_file():
            source = run if r else out / NOISES[-1].replace(",", "+")
            model, tok = load_model(source), load_tokenizer(source / "tokenizer.json")
            if not r:
                torch.manual_seed(0)
                model = build_model(model.config)
            job = PairsJob(model, tok, train_pairs, test_pairs, model.config.pad_token_id, 1e-3, 20, 32, 0)
            TrainLoop(job, LoopSettings(lr=1e-3, max_steps=ft_steps, min_lr=5e-5, precision="fp32", log_every=50,
                                        eval_every=ft_steps), None).fit()
            done.write_text(json.dumps(job.result or {"val_loss": float("nan"), **evaluate_pairs(model, tok, test_pairs)}))
        d = json.loads(done.read_text())
        own, spent = (f"{r['val_loss']:.3f}", f"{r['cpu_s']:.0f}") if r else ("-", "0")
        lines.append(f"| {noise} | {own} | {spent} | {d['val_loss']:.3f} | {d['bleu']:.1f} | "
                     f"{d.get('exact_match', float('nan')):.3f} |")
        print(lines[-1], flush=True)
    return "\n".join(lines)


def features(model, tok, texts: list[str], max_length: int = 128):
    """Mean of the last hidden states over each text's positions (its frame, if the tokenizer adds one), (N, d)."""
    import torch

    rows = []
    with torch.no_grad():
        for text in texts:
            ids = tok.encode(text)[:max_length]
            h = model(torch.tensor([ids])).last_hidden_state[0]
            rows.append(h.mean(0))  # (d,)
    return torch.stack(rows)


def probe(train_x, train_y, test_x, test_y) -> float:
    """Accuracy of an L2-regularised logistic regression on standardised features."""
    from sklearn.linear_model import LogisticRegression
    from sklearn.preprocessing import StandardScaler

    scale = StandardScaler().fit(train_x)
    clf = LogisticRegression(max_iter=2000, C=1.0).fit(scale.transform(train_x), train_y)
    return float(clf.score(scale.transform(test_x), test_y))


def checkpoints(run: Path) -> list[tuple[int, Path]]:
    return sorted((int(p.name.split("-")[1]), p / "model.safetensors") for p in (run / "checkpoint").glob("step-*"))


def part_efficiency(out: Path, steps: int, points: int) -> str:
    from safetensors.torch import load_file

    from lmkit.hub import load_model
    from lmkit.tokenizers import load_tokenizer

    train_ex, test_ex = topic_split()
    every = max(1, steps // points)
    shape = {"d_model": 128, "n_layers": 2, "n_heads": 2, "d_ff": 512, "max_seq_len": 128}
    same = dict(lr=1e-3, warmup_steps=max(1, steps // 10), vocab_size=4096)  # tiny's recipe would differ
    runs = {"CLM (next token, 100% of positions)": dict(
                preset="tiny", objective="clm", model_overrides={**shape, "dropout": 0.1, "attention_dropout": 0.1},
                **same),
            "MLM (15% of positions)": dict(preset="bert-tiny", objective="mlm", **same)}
    lines = ["| objective | step | tokens seen | tokens with a loss | own val loss | topic probe acc |",
             "|---|---|---|---|---|---|"]
    curves = {}
    for i, (name, settings) in enumerate(runs.items()):
        run = out / f"model-{i}"
        pretrain(run, steps, save_every=every, eval_every=every, keep_checkpoints=points + 1,
                 **settings)
        rows = {m["step"]: m for m in map(json.loads, (run / "metrics.jsonl").read_text().splitlines())
                if "val_loss" in m}
        model, tok = load_model(run), load_tokenizer(run / "tokenizer.json")
        model.eval()
        share = 1.0 if settings["objective"] == "clm" else 0.15  # MLM's loss: 15% of the positions
        curves[name] = []
        for step, weights in checkpoints(run):
            missing = model.load_state_dict(load_file(str(weights)), strict=False).missing_keys
            assert all(k in ("lm_head.weight", "mlm_head.decoder.weight") for k in missing), missing  # tied heads: saved once
            acc = probe(features(model, tok, [e.text for e in train_ex], SEQ), [e.label for e in train_ex],
                        features(model, tok, [e.text for e in test_ex], SEQ), [e.label for e in test_ex])
            m = rows.get(step, {})
            tokens = step * BATCH * SEQ  # packed rows: every position a token
            curves[name].append((tokens, acc, m.get("val_loss")))
            loss = m.get("val_masked_loss", m.get("val_loss"))
            lines.append(f"| {name} | {step} | {tokens:,} | {int(tokens * share):,} | "
                         f"{'-' if loss is None else f'{loss:.3f}'} | {acc:.3f} |")
            print(lines[-1], flush=True)
    (out / "curves.json").write_text(json.dumps(curves))
    return "\n".join(lines)


def main() -> None:
    global BATCH, SEQ
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--part", choices=("nsp", "noise", "efficiency"), required=True)
    ap.add_argument("--out", default="runs/encoders_pretrain")
    ap.add_argument("--steps", type=int, default=100, help="pre-training steps of every run (default 100)")
    ap.add_argument("--batch-size", type=int, default=BATCH, help=f"rows per step (default {BATCH})")
    ap.add_argument("--seq-len", type=int, default=SEQ, help=f"tokens per row (default {SEQ})")
    ap.add_argument("--seeds", type=int, default=1, help="nsp: fine-tune seeds per model (default 1)")
    ap.add_argument("--ft-steps", type=int, default=40, help="noise: numbers fine-tune steps (default 40)")
    ap.add_argument("--points", type=int, default=4, help="efficiency: checkpoints probed per run (default 4)")
    ap.add_argument("--layers", type=int, default=2, help="nsp: encoder layers (default 2, bert-tiny's)")
    ap.add_argument("--heads", type=int, default=2, help="nsp: attention heads (default 2, bert-tiny's)")
    ap.add_argument("--lr", type=float, default=None, help="nsp: peak learning rate (default: the preset recipe's)")
    ap.add_argument("--warmup", type=int, default=None, help="nsp: warm-up steps (default: the preset recipe's)")
    ap.add_argument("--eval-every", type=int, default=None, help="nsp: validate every N steps (default: at the end)")
    args = ap.parse_args()
    BATCH, SEQ = args.batch_size, args.seq_len
    out = Path(args.out) / args.part
    out.mkdir(parents=True, exist_ok=True)
    start = cpu()
    if args.part == "nsp":
        recipe = {"model_overrides": {"n_layers": args.layers, "n_heads": args.heads}}
        given = (("lr", args.lr), ("warmup_steps", args.warmup), ("eval_every", args.eval_every))
        recipe.update({k: v for k, v in given if v is not None})
        table = part_nsp(out, args.steps, args.seeds, recipe)
    elif args.part == "noise":
        table = part_noise(out, args.steps, args.ft_steps)
    else:
        table = part_efficiency(out, args.steps, args.points)
    print(table)
    print(f"CPU seconds in this process: {cpu() - start:.0f}")
    (out / f"{args.part}.md").write_text(table + "\n")


if __name__ == "__main__":
    main()
