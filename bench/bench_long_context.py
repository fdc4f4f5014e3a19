"""Extending a RoPE model's window: perplexity by position and passkey retrieval, for no extension, position
interpolation, NTK (dynamic) and YaRN without fine-tuning, NTK and YaRN fine-tuned at 4x, and LongLoRA.

A small LLaMA-style model is trained at 256 tokens on a built-in corpus (pycode: Python standard-library files,
whose long files give real long-range structure) mixed with passkey documents (Mohtashami and Jaggi 2023: a
five-digit key hidden in repeated filler, asked for at the end; fresh keys at random depths, three rows in four by
default: at 40% and 500 steps the copy had not formed), so that retrieval within the trained window is a skill
the model has (checked on held-out prompts at 256 tokens before the variants are scored). Each variant is then scored on held-out pycode files (never trained on) at 2048 tokens:
perplexity per position bucket (0-256 the trained window, up to 4x and 8x), and passkey accuracy by length and
depth of the key (all of the key's tokens the argmax, teacher forced: what greedy decoding would write).

Fine-tuned variants run `lmkit finetune --task clm` in process (`finetune_causal_lm_folder`) at 1024 tokens
(factor 4) on the same mixture, whose passkey documents then fill up to 1024 tokens; LongLoRA trains LoRA+
(embeddings and norms in full) with S2-Attn and position interpolation, as the paper does.

    python bench/bench_long_context.py [--work runs/bench-long-context] [--steps 1100] [--passkey-share 0.75]
"""
from __future__ import annotations

import argparse
import json
import math
import random
import sys
import time
from pathlib import Path

import torch

from lmkit.atomic import atomic_write_json, atomic_write_text

sys.path.insert(0, str(Path(__file__).resolve().parent))
from machine import cpu_name  # noqa: E402

FILLER = ("The grass is green.", "The sky is blue.", "The sun is yellow.", "Here we go.", "There and back again.")
INTRO = "There is a pass key hidden inside a lot of irrelevant text. Find it and remember it."
QUESTION = "What is the pass key? The pass key is"
BUCKETS = ((0, 256), (256, 512), (512, 1024), (1024, 2048))


def passkey_text(n_before: int, n_after: int, key: int, answer: bool = True) -> str:
    """INTRO, n_before filler sentences, the key line, n_after filler sentences, the question (and the key)."""
    fill = lambda n, start: " ".join(FILLER[(start + i) % len(FILLER)] for i in range(n))  # noqa: E731
    parts = [INTRO, fill(n_before, 0), f"The pass key is {key}. Remember it. {key} is the pass key.",
             fill(n_after, n_before), QUESTION]
    text = " ".join(p for p in parts if p)
    return f"{text} {key}." if answer else text


def passkey_docs(n: int, max_sentences: int, rng: random.Random) -> list[str]:
    docs = []
    for _ in range(n):
        total = rng.randint(0, max_sentences)
        before = rng.randint(0, total)
        docs.append(passkey_text(before, total - before, rng.randint(10000, 99999)))
    return docs


def write_corpora(work: Path, train_chars: int, n_heldout: int, share: float) -> tuple[Path, Path, list[str]]:
    """(base corpus .jsonl, fine-tuning corpus .jsonl, held-out pycode texts) in `work`: the pycode files and, as
    `share` of the training rows, passkey documents with fresh keys at random depths (up to ~250 tokens for the
    base, whose rows are 256, up to ~870 for the fine-tuning at 1024)."""
    from lmkit.data.builtin import builtin_corpus

    docs = sorted(builtin_corpus("pycode").documents, key=lambda d: d.id)
    heldout = [d.text for i, d in enumerate(docs) if i % 25 == 7 and len(d.text) > 16000][:n_heldout]
    rest = [d.text for i, d in enumerate(docs) if i % 25 != 7]
    random.Random(0).shuffle(rest)
    code, total = [], 0
    for t in rest:
        if total > train_chars:
            break
        code.append(t)
        total += len(t)
    rng = random.Random(1)
    paths = []
    for name, max_sentences, seq_len in (("base", 40, 256), ("finetune", 170, 1024)):
        # a row starts at the start of a piece (a document cut at seq_len tokens, ~3.3 characters each)
        pieces = sum(math.ceil(len(t) / (3.3 * seq_len)) for t in code)
        path = work / f"{name}.jsonl"
        texts = code + passkey_docs(round(pieces * share / (1 - share)), max_sentences, rng)
        random.Random(2).shuffle(texts)
        atomic_write_text(path, "".join(json.dumps({"text": t}) + "\n" for t in texts))
        paths.append(path)
    return paths[0], paths[1], heldout


def train_base(work: Path, corpus: Path, steps: int, batch: int, lr: float | None) -> Path:
    from lmkit.train.config import TrainConfig
    from lmkit.train.trainer import train

    out = work / "base"
    if (out / "config.json").is_file():
        return out
    cfg = TrainConfig(preset="default", corpus=[str(corpus)], out=str(out), max_steps=steps, batch_size=batch,
                      seq_len=256, vocab_size=2048, progress=False, save_every=max(1, steps // 8), eval_every=steps, lr=lr,
                      model_overrides=dict(d_model=128, n_layers=4, n_heads=4, n_kv_heads=2, dropout=0.0))
    train(cfg)
    return out


def finetune(work: Path, base: Path, corpus: Path, name: str, kind: str, steps: int, batch: int, **extra) -> Path:
    from lmkit.finetune.clm import finetune_causal_lm_folder

    out = work / name
    if not (out / "config.json").is_file():
        method = extra.pop("method", "full")
        finetune_causal_lm_folder(base, out, method=method, corpus=[str(corpus)], steps=steps, batch_size=batch,
                                  seq_len=1024, rope_scaling=kind, rope_factor=4.0, max_val_docs=4, **extra)
    return out


def load(folder: Path, kind: str | None = None, factor: float | None = None):
    from lmkit.finetune.common import model_folder
    from lmkit.finetune.context import extend_window

    model, tok = model_folder(folder)
    if kind is not None:
        extend_window(model, kind, factor, None)
    return model.eval(), tok


def encode(tok, text: str) -> list[int]:
    ids = tok.encode(text, add_special_tokens=False)
    return list(getattr(ids, "ids", ids))


@torch.no_grad()
def position_nll(model, rows: torch.Tensor) -> torch.Tensor:
    """Mean next-token loss (nats) at each position, over the rows (N, T + 1)."""
    total = torch.zeros(rows.shape[1] - 1, dtype=torch.float64)
    for i in range(0, len(rows), 2):
        r = rows[i:i + 2]
        logits = model(r[:, :-1]).logits.float()
        nll = torch.nn.functional.cross_entropy(logits.transpose(1, 2), r[:, 1:], reduction="none")
        total += nll.double().sum(0)
    return total / len(rows)


@torch.no_grad()
def passkey_accuracy(model, tok, bos: int, length: int, depth: float, trials: int, seed: int) -> dict:
    """Over `trials` prompts of about `length` tokens, the key at `depth` of the filler: "exact", the share whose
    key tokens are each the argmax after the prompt and the key's tokens before them (what greedy decoding
    writes); "tokens", the share of key tokens that are; "nll", the key's mean loss per token (nats)."""
    rng = random.Random(seed)
    per = len(encode(tok, " ".join(FILLER))) / len(FILLER)
    n = max(0, round((length - len(encode(tok, passkey_text(0, 0, 12345)))) / per))
    while n > 0 and len(encode(tok, passkey_text(n, 0, 12345))) + 1 > length:
        n -= 1
    hits, right, count, nll = 0, 0, 0, 0.0
    for _ in range(trials):
        key = rng.randint(10000, 99999)
        before = round(n * depth)
        prompt = [bos] + encode(tok, passkey_text(before, n - before, key, answer=False))
        full = [bos] + encode(tok, passkey_text(before, n - before, key, answer=False) + f" {key}")
        assert full[:len(prompt)] == prompt
        ids = torch.tensor([full])
        logits, want = model(ids[:, :-1]).logits[0, len(prompt) - 1:].float(), ids[0, len(prompt):]
        pred = logits.argmax(-1)
        hits += int(torch.equal(pred, want))
        right, count = right + int((pred == want).sum()), count + len(want)
        nll += float(torch.nn.functional.cross_entropy(logits, want, reduction="sum"))
    return {"exact": hits / trials, "tokens": right / count, "nll": nll / count}


@torch.no_grad()
def retrieval_check(model, tok, length: int = 256, prompts: int = 60, seed: int = 12345) -> float:
    """Share of `prompts` held-out passkey prompts of about `length` tokens, each key at a random depth, whose whole
    key greedy decoding writes (prompts drawn apart from the training documents, from another seed)."""
    from lmkit.data.tokenize import special_ids

    bos, _ = special_ids(tok)
    rng = random.Random(seed)
    return sum(passkey_accuracy(model, tok, bos, length, rng.random(), 1, rng.randrange(1 << 30))["exact"]
               for _ in range(prompts)) / prompts


def score(model, tok, rows, lengths, depths, trials) -> dict:
    from lmkit.data.tokenize import special_ids

    bos, _ = special_ids(tok)
    nll = position_nll(model, rows)
    ppl = {f"{a}-{b}": math.exp(float(nll[a:b].mean())) for a, b in BUCKETS if b <= len(nll)}
    keys = {f"{n}@{d}": passkey_accuracy(model, tok, bos, n, d, trials, seed=n * 7 + int(d * 100))
            for n in lengths for d in depths}
    return {"ppl": ppl, "passkey": keys, "nll_by_64": [float(nll[i:i + 64].mean()) for i in range(0, len(nll), 64)]}


def plot(results: dict, path: str) -> None:
    """Left: each variant's perplexity per 64-token bucket over no extension's; right: passkey accuracy by length."""
    from lmkit.plots import new_figure, save

    fig = new_figure(11, 4.2)
    ax1, ax2 = fig.add_subplot(1, 2, 1), fig.add_subplot(1, 2, 2)
    ref = results["none"]["nll_by_64"]
    for name, r in results.items():
        xs = [64 * i + 32 for i in range(len(r["nll_by_64"]))]
        ax1.plot(xs, [math.exp(v - w) for v, w in zip(r["nll_by_64"], ref)], label=name)
        lengths = sorted({int(k.split("@")[0]) for k in r["passkey"]})
        ax2.plot(lengths, [sum(v["exact"] for k, v in r["passkey"].items() if int(k.split("@")[0]) == n)
                           / sum(1 for k in r["passkey"] if int(k.split("@")[0]) == n) for n in lengths],
                 marker="o", label=name)
    ax1.axvline(256, color="grey", lw=0.8, ls="--")
    ax1.set(xscale="log", xlabel="position (tokens; trained at 256)",
            ylabel="perplexity / no extension's (64-token buckets)", title="Held-out perplexity by position")
    ax2.set(xscale="log", xlabel="prompt length (tokens)", ylabel="whole key right (mean over depths)",
            title="Passkey retrieval", ylim=(-0.03, 1.03))
    ax2.legend(fontsize=7)
    save(fig, path)


def markdown(results: dict, lengths, depths, setting: str) -> str:
    lines = [setting, "", "Held-out perplexity by position bucket (tokens):", "",
             "| variant | " + " | ".join(f"{a}-{b}" for a, b in BUCKETS) + " |",
             "| --- |" + " ---: |" * len(BUCKETS)]
    for name, r in results.items():
        lines.append(f"| {name} | " + " | ".join(f"{r['ppl'].get(f'{a}-{b}', float('nan')):.2f}" for a, b in BUCKETS) + " |")
    mean = lambda r, n, key: sum(r["passkey"][f"{n}@{d}"][key] for d in depths) / len(depths)  # noqa: E731
    lines += ["", "Passkey by prompt length, mean over depths " + ", ".join(f"{d:g}" for d in depths)
              + ": whole key right (greedy) / share of key tokens right / key loss (nats per token):", "",
              "| variant | " + " | ".join(str(n) for n in lengths) + " |", "| --- |" + " ---: |" * len(lengths)]
    for name, r in results.items():
        cells = [f"{mean(r, n, 'exact'):.2f} / {mean(r, n, 'tokens'):.2f} / {mean(r, n, 'nll'):.2f}" for n in lengths]
        lines.append(f"| {name} | " + " | ".join(cells) + " |")
    lines += ["", "Passkey retrieval by length x depth of the key: share of prompts whose whole key greedy decoding "
              "writes (columns: length@depth):", "",
              "| variant | " + " | ".join(f"{n}@{d:g}" for n in lengths for d in depths) + " |",
              "| --- |" + " ---: |" * (len(lengths) * len(depths))]
    for name, r in results.items():
        lines.append(f"| {name} | " + " | ".join(f"{r['passkey'][f'{n}@{d}']['exact']:.2f}" for n in lengths
                                                 for d in depths) + " |")
    return "\n".join(lines) + "\n"


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--work", default="runs/bench-long-context", help="run folders (default: %(default)s)")
    p.add_argument("--steps", type=int, default=1100, help="base training steps at 256 tokens (default: %(default)s)")
    p.add_argument("--lr", type=float, default=None, help="base learning rate (default: the preset's)")
    p.add_argument("--passkey-share", type=float, default=0.75,
                   help="share of training rows that are passkey documents (default: %(default)s)")
    p.add_argument("--batch-size", type=int, default=8, help="base rows per step (default: %(default)s)")
    p.add_argument("--ft-steps", type=int, default=30, help="fine-tuning steps at 1024 (default: %(default)s)")
    p.add_argument("--ft-batch-size", type=int, default=4, help="fine-tuning rows per step (default: %(default)s)")
    p.add_argument("--train-chars", type=int, default=2_000_000, help="pycode characters trained on (default: %(default)s)")
    p.add_argument("--heldout", type=int, default=4, help="held-out files of 2048 tokens (default: %(default)s)")
    p.add_argument("--trials", type=int, default=10, help="passkey prompts per length and depth (default: %(default)s)")
    p.add_argument("--json", default="bench/results/long_context.json", help="results (default: %(default)s)")
    p.add_argument("--table", default="bench/results/long_context.md", help="Markdown tables (default: %(default)s)")
    p.add_argument("--plot", default="docs/img/long_context.png", help="plot (default: %(default)s)")
    p.add_argument("--replot", action="store_true", help="only draw --plot again from --json (default: off)")
    args = p.parse_args()
    if args.replot:
        plot(json.loads(Path(args.json).read_text())["results"], args.plot)
        return
    torch.set_num_threads(1)
    work = Path(args.work)
    work.mkdir(parents=True, exist_ok=True)
    t0 = time.process_time()
    fresh = not (work / "base" / "config.json").is_file()
    base_corpus, ft_corpus, heldout = write_corpora(work, args.train_chars, args.heldout, args.passkey_share)
    base = train_base(work, base_corpus, args.steps, args.batch_size, args.lr)
    t_base = time.process_time() - t0
    tuned = {
        "NTK x4 + fine-tune": finetune(work, base, ft_corpus, "ntk-ft", "dynamic", args.ft_steps, args.ft_batch_size, lr=5e-4),
        "YaRN x4 + fine-tune": finetune(work, base, ft_corpus, "yarn-ft", "yarn", args.ft_steps, args.ft_batch_size, lr=5e-4),
        "LongLoRA (PI x4)": finetune(work, base, ft_corpus, "longlora", "linear", args.ft_steps, args.ft_batch_size,
                                     method="lora", longlora=True),
    }
    t_ft = time.process_time() - t0 - t_base
    times = work / "cpu_seconds.json"  # a rerun that finds the run folders reports the times they took
    if times.is_file() and not fresh:
        t_base, t_ft = json.loads(times.read_text())
    else:
        atomic_write_json(times, [t_base, t_ft])
    print(f"base trained: {t_base:.0f} s CPU, fine-tuned: {t_ft:.0f} s CPU", flush=True)
    from lmkit.data.tokenize import special_ids

    model, tok = load(base)
    bos, _ = special_ids(tok)
    check = retrieval_check(model, tok)
    print(f"base: whole key right on {check:.2f} of 60 held-out passkey prompts of 256 tokens", flush=True)
    rows = torch.tensor([[bos] + encode(tok, t)[:2048] for t in heldout])
    assert rows.shape[1] == 2049, "held-out files shorter than 2048 tokens"
    lengths, depths = (256, 1024, 2048), (0.1, 0.5, 0.9)
    variants = {"none": (base, None, None), "PI x4": (base, "linear", 4.0), "PI x8": (base, "linear", 8.0),
                "NTK x4": (base, "dynamic", 4.0), "NTK x8": (base, "dynamic", 8.0),
                "YaRN x4": (base, "yarn", 4.0), "YaRN x8": (base, "yarn", 8.0),
                **{name: (folder, None, None) for name, folder in tuned.items()}}
    results = {}
    for name, (folder, kind, factor) in variants.items():
        model, tok = load(folder, kind, factor)
        results[name] = score(model, tok, rows, lengths, depths, args.trials)
        print(name, json.dumps(results[name]["ppl"]), flush=True)
    setting = (f"CPU: {cpu_name()}, one thread. Base: LLaMA-style, width 128, 4 layers, 4 heads (2 key/value heads), "
               f"vocabulary 2048, {args.steps} steps x {args.batch_size} rows of 256 tokens ({t_base:.0f} s CPU) on "
               f"{args.train_chars / 1e6:.1f} MB of pycode plus passkey documents ({args.passkey_share:.0%} of the rows); "
               f"held-out retrieval at 256 tokens after it: {check:.2f} (60 prompts, random depths); fine-tuning {args.ft_steps} steps x "
               f"{args.ft_batch_size} rows of 1024 ({t_ft:.0f} s CPU for the three); {len(rows)} held-out files; "
               f"{args.trials} passkey prompts per length and depth.")
    Path(args.json).parent.mkdir(parents=True, exist_ok=True)
    atomic_write_json(args.json, {"setting": setting, "base_retrieval_256": check, "results": results}, indent=1)
    table = markdown(results, lengths, depths, setting)
    atomic_write_text(args.table, table)
    print(table)
    if args.plot:
        plot(results, args.plot)


if __name__ == "__main__":
    main()
