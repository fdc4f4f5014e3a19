"""Emergence as a measured question (Wei et al. 2022; Schaeffer et al. 2023): decoders of growing size trained on
the same addition data for the same steps, scored on the held-out d-digit sums by a sharp metric (exact match of the
greedy answer) and by continuous ones (mean log-likelihood per answer token, and the token edit distance of the
greedy answer to the right one), each against training compute C = 6 N D.

Data and tokenizer are experiment_cot.py's "direct" corpus (answers alone, every digit a token). Prints a table and
writes docs/img/emergence.png.

    nice -n 19 python bench/experiment_emergence.py [--out runs/emergence] [--steps 600]
"""
from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))
import experiment_cot as cot  # noqa: E402

SIZES = ((1, 32), (2, 48), (2, 64), (3, 96), (4, 128))  # (layers, d_model)
TEST_DIGITS = (2, 3)


def edit_distance(a: list[int], b: list[int]) -> int:
    row = list(range(len(b) + 1))
    for i, x in enumerate(a, 1):
        prev, row[0] = row[0], i
        for j, y in enumerate(b, 1):
            prev, row[j] = row[j], min(row[j] + 1, row[j - 1] + 1, prev + (x != y))
    return row[-1]


def score(folder: Path, digits: int, limit: int) -> dict:
    """Exact match of the greedy answer, mean log p per answer token, mean token edit distance."""
    import torch

    import lmkit
    from lmkit.evaluate.harness_tasks.lmkit_tasks import addition

    model, tok = lmkit.load_model(folder), lmkit.load_tokenizer(folder)
    test = addition(digits)["test"]
    rows = [test[i] for i in range(min(limit, len(test)))]
    exact = logp = dist = tokens = 0.0
    for row in rows:
        prompt = tok.encode(f"Question: {row['question']}\nAnswer: The answer is")
        target = tok.encode(f" {row['answer']}.")
        ids = torch.tensor([prompt + target])
        with torch.no_grad():
            logits = model(ids).logits[0, len(prompt) - 1:-1].float().log_softmax(-1)
        logp += float(logits.gather(1, torch.tensor(target)[:, None]).sum())
        tokens += len(target)
        out = model.generate(torch.tensor([prompt]), max_new_tokens=len(target) + 2, do_sample=False)
        got = out[0, len(prompt):len(prompt) + len(target)].tolist()
        exact += got == target
        dist += edit_distance(got, target)
    return {"exact_match": exact / len(rows), "logp_per_token": logp / tokens, "edit_distance": dist / len(rows)}


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--out", default="runs/emergence")
    ap.add_argument("--steps", type=int, default=600)
    ap.add_argument("--batch-size", type=int, default=16)
    ap.add_argument("--seq-len", type=int, default=256)
    ap.add_argument("--limit", type=int, default=100)
    args = ap.parse_args()
    out = Path(args.out)
    corpora = cot.write_corpora(out / "data", 20000, 0)
    tokenizer = cot.write_tokenizer(out / "tokenizer.json", corpora, 282)
    shards = cot.prepare_shards(out / "shards", corpora["direct"], tokenizer)
    from lmkit.train import TrainConfig, train

    rows = []
    for layers, d in SIZES:
        model = out / f"model-{layers}x{d}"
        if not (model / "model.safetensors").is_file():
            train(TrainConfig(preset="tiny", data=str(shards), out=str(model), max_steps=args.steps,
                              batch_size=args.batch_size, seq_len=args.seq_len, lr=3e-3, warmup_steps=50,
                              optimizer="adamw", precision="fp32", seed=0, log_every=100, progress=False,
                              model_overrides=dict(n_layers=layers, d_model=d, n_heads=max(1, d // 32), dropout=0.0)))
        import lmkit
        from lmkit.scaling.shapes import count_parameters

        n = count_parameters(lmkit.load_model(model))
        compute = 6 * n * args.steps * args.batch_size * args.seq_len
        for digits in TEST_DIGITS:
            rows.append({"size": f"{layers}x{d}", "params": n, "compute": compute, "digits": digits,
                         **score(model, digits, args.limit)})
            print(json.dumps(rows[-1]), flush=True)
    (out / "results.jsonl").write_text("".join(json.dumps(r) + "\n" for r in rows))
    print("| model | parameters | compute (FLOPs) | digits | exact match | log p per answer token | token edit distance |")
    print("|---|---|---|---|---|---|---|")
    for r in rows:
        print(f"| {r['size']} | {r['params']:,} | {r['compute']:.2e} | {r['digits']} | {r['exact_match']:.2f} | "
              f"{r['logp_per_token']:.3f} | {r['edit_distance']:.2f} |")
    import matplotlib

    matplotlib.use("Agg")
    from matplotlib.figure import Figure

    fig = Figure(figsize=(10, 3.6))
    axes = fig.subplots(1, 3)
    for digits in TEST_DIGITS:
        sub = [r for r in rows if r["digits"] == digits]
        for ax, key, label in zip(axes, ("exact_match", "logp_per_token", "edit_distance"),
                                  ("exact match (sharp)", "log p per answer token (continuous)",
                                   "token edit distance (continuous)")):
            ax.plot([r["compute"] for r in sub], [r[key] for r in sub], "o-", label=f"{digits}-digit sums")
            ax.set_xscale("log")
            ax.set_xlabel("training compute (FLOPs)")
            ax.set_title(label, fontsize=9)
    axes[0].legend(fontsize=8)
    fig.tight_layout()
    fig.savefig(Path(__file__).resolve().parent.parent / "docs" / "img" / "emergence.png", dpi=110)


if __name__ == "__main__":
    main()
