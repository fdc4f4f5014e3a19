"""Chain of thought at small scale: one small decoder trained for the same compute on addition written as steps and
on answers alone, both scored through `lmkit harness` on addition_cot_d1..d4, addition_direct_d1..d4 and
addition_cot_zeroshot_d1..d4.

The two corpora hold the same problems (seeded, 1 to 4 digits, the harness's test problems left out) in the
prompt format of the harness tasks, "Question: 15+27\\nAnswer: ...", problems of a document separated by blank
lines. In `cot.jsonl` the answer is the worked trace (`15+27 = (10+5)+(20+7) = 30+12 = 42. The answer is 42.`),
in `direct.jsonl` it is `The answer is 42.` alone. One byte-level BPE fitted to both corpora, with every digit a
token of its own (pattern "digits"), tokenizes both into shards (`lmkit data prepare`). Both runs train the same
model (the preset's architecture at --layers x --d-model) with the same steps, batch and sequence length: the same
tokens seen, so the same compute; the direct corpus packs more problems into those tokens. The two trainings run
side by side, one thread each (OMP_NUM_THREADS=1), for a fixed number of steps: the result is a function of the
flags and seeds, not of the machine's load. The harness runs with max_gen_toks raised to --max-gen-toks, as a
4-digit trace of one-digit tokens is longer than the tasks' 64.

    nice -n 19 python bench/experiment_cot.py [--out runs/cot-experiment] [--steps 2000] [--limit 100]

The defaults are the documented run (2000 steps of 32 rows, about 80 minutes on the shared 2-core machine). The
short run of docs/harness.md, a tenth of the tokens, is `--steps 400 --batch-size 16 --warmup 40 --limit 50` (28
minutes side by side at a load of 10): too few tokens for either model to learn addition.

Prints the table of exact match (strict "The answer is N" and flexible last-number extraction) by digits, for each
trained model under both prompts, and writes it to OUT/table.md with the results JSON of each harness run (and the
logs of each training and harness run). Steps already done (corpora, shards, models, results) are reused.
"""
from __future__ import annotations

import argparse
import json
import os
import random
import subprocess
import sys
from pathlib import Path

from lmkit.evaluate.harness_tasks.lmkit_tasks import addition, addition_problems, addition_trace

DIGITS = (1, 2, 3, 4)
PROBLEMS_PER_DOCUMENT = 16
STEPS, BATCH = 2000, 32
# the harness tasks of each prompt: 3 worked exemplars, 3 answer-only exemplars, and zero-shot CoT (Kojima et al.'s
# trigger "Let's think step by step." opening the answer, no exemplar)
PROMPTS = {"cot": "cot exemplars", "direct": "direct exemplars", "cot_zeroshot": "zero-shot, \"Let's think step by step.\""}


def held_out(digits: int) -> set[tuple[int, int]]:
    """The test problems of addition_*_d{digits}: never trained on."""
    return {tuple(map(int, row["question"].split("+"))) for row in addition(digits)["test"]}


def training_problems(count: int, seed: int) -> list[tuple[int, int]]:
    """`count` problems per number of digits, shuffled together; one digit has few problems outside the test
    set (50 of 81), which repeat."""
    rng = random.Random(f"cot-corpus-{seed}")
    out: list[tuple[int, int]] = []
    for d in DIGITS:
        avoid = held_out(d)
        pool = addition_problems(d, count, rng, avoid=avoid)
        out += [pool[i % len(pool)] for i in range(count)]
    rng.shuffle(out)
    return out


def write_corpora(folder: Path, count: int, seed: int) -> dict[str, Path]:
    """cot.jsonl and direct.jsonl: the same problems, in the same documents, answered two ways."""
    folder.mkdir(parents=True, exist_ok=True)
    problems = training_problems(count, seed)
    answers = {"cot": addition_trace, "direct": lambda a, b: f"The answer is {a + b}."}
    paths = {}
    for kind, answer in answers.items():
        lines = []
        for start in range(0, len(problems), PROBLEMS_PER_DOCUMENT):
            block = problems[start:start + PROBLEMS_PER_DOCUMENT]
            text = "\n\n".join(f"Question: {a}+{b}\nAnswer: {answer(a, b)}" for a, b in block)
            lines.append(json.dumps({"id": f"{kind}-{start // PROBLEMS_PER_DOCUMENT}", "text": text}))
        paths[kind] = folder / f"{kind}.jsonl"
        tmp = paths[kind].with_suffix(".tmp")
        tmp.write_text("\n".join(lines) + "\n", encoding="utf-8")
        os.replace(tmp, paths[kind])
    return paths


def write_tokenizer(path: Path, corpora: dict[str, Path], vocab_size: int) -> Path:
    """One byte-level BPE for both runs, fitted to both corpora, whose pre-tokenizer puts every digit alone
    (pattern "digits"): a number is its digits, so 15 and 1500 share the 1 and the 5, and no merge hides a carry."""
    if not path.is_file():
        from lmkit.data import load_corpus
        from lmkit.data.tokenize import SPECIAL_TOKENS
        from lmkit.tokenizers import train_tokenizer

        texts = load_corpus([str(p) for p in corpora.values()]).texts()
        tok = train_tokenizer(texts, "bpe", vocab_size, special_tokens=list(SPECIAL_TOKENS), pattern="digits")
        tmp = path.with_suffix(".tmp")
        tok.save(tmp)
        os.replace(tmp, path)
    return path


def prepare_shards(folder: Path, corpus: Path, tokenizer: Path) -> Path:
    if not (folder / "index.json").is_file():
        from lmkit.data.prepare import prepare

        prepare([str(corpus)], tokenizer, folder, workers=1, overwrite=True)
    return folder


def train_config(args: argparse.Namespace, shards: Path, model: Path):
    from lmkit.train import TrainConfig

    overrides = dict(n_layers=args.layers, d_model=args.d_model, n_heads=args.heads, dropout=0.0)
    return TrainConfig(preset=args.preset, data=str(shards), out=str(model), max_steps=args.steps,
                       batch_size=args.batch_size, seq_len=args.seq_len, lr=args.lr, warmup_steps=args.warmup,
                       optimizer="adamw", precision=args.precision, seed=args.seed, log_every=50,
                       eval_every=args.steps, model_overrides=overrides)


def trained_steps(model: Path) -> int:
    """The step of the run's newest checkpoint (0: none): a folder saved mid-run already holds a model."""
    from lmkit.train.checkpoint import latest_checkpoint

    checkpoint = latest_checkpoint(model) if model.is_dir() else None
    return json.loads((checkpoint / "state.json").read_text(encoding="utf-8"))["step"] if checkpoint else 0


def checkpoint_folder(model: Path, step: int, folder: Path) -> Path:
    """The run's checkpoint at `step` as a model folder of its own (the run's config and tokenizer)."""
    if not (folder / "model.safetensors").is_file():
        import shutil

        import lmkit
        from lmkit.train.checkpoint import load_checkpoint
        from lmkit.train.setup import TOKENIZER_FILES

        path = model / "checkpoint" / f"step-{step:08d}"
        if not path.is_dir():
            sys.exit(f"experiment_cot: {path} is missing (checkpoints are kept every few hundred steps, the newest 3)")
        net = lmkit.load_model(model)
        load_checkpoint(path, net, None)
        net.save_pretrained(folder)
        for name in TOKENIZER_FILES:
            shutil.copy(model / name, folder / name)
    return folder


def train_one(args: argparse.Namespace) -> None:
    """The training of one corpus (a process of its own, so that the two runs go side by side); an interrupted
    run resumes from its newest checkpoint."""
    import torch

    from lmkit.train import train

    torch.set_num_threads(1)
    out = Path(args.out)
    model = out / f"model-{args.train_one}"
    cfg = train_config(args, out / f"shards-{args.train_one}", model)
    cfg.resume = trained_steps(model) > 0
    print(json.dumps(train(cfg)), flush=True)


def run_all(commands: list[tuple[list[str], Path]]) -> None:
    """The commands side by side, one thread each, output to their log files; fails if any fails."""
    env = dict(os.environ, OMP_NUM_THREADS="1")
    running = []
    for command, log in commands:
        with open(log, "a", encoding="utf-8") as f:
            running.append((subprocess.Popen(command, env=env, stdout=f, stderr=subprocess.STDOUT), log))
    failed = [str(log) for process, log in running if process.wait() != 0]
    if failed:
        sys.exit(f"experiment_cot: failed, see {', '.join(failed)}")


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--out", default="runs/cot-experiment")
    ap.add_argument("--preset", default="tiny", help="the architecture (tiny: GPT-2 style); its sizes are the next flags'")
    ap.add_argument("--layers", type=int, default=4)
    ap.add_argument("--d-model", type=int, default=128)
    ap.add_argument("--heads", type=int, default=4)
    ap.add_argument("--steps", type=int, default=STEPS)
    ap.add_argument("--batch-size", type=int, default=BATCH)
    ap.add_argument("--seq-len", type=int, default=384)
    ap.add_argument("--lr", type=float, default=2e-3)
    ap.add_argument("--warmup", type=int, default=100, help="warm-up steps")
    ap.add_argument("--precision", default="bf16", choices=("fp32", "bf16"), help="bf16: twice as fast where native")
    ap.add_argument("--vocab-size", type=int, default=320)
    ap.add_argument("--problems", type=int, default=30000, help="training problems per number of digits")
    ap.add_argument("--limit", type=int, default=100, help="test problems per task (of 200; 31 for one digit)")
    ap.add_argument("--max-gen-toks", type=int, default=80,
                    help="generation cap of the harness (the tasks' 64 cuts a 4-digit trace of one-digit tokens)")
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--at-step", type=int, metavar="N",
                    help="score the runs' checkpoints at step N (into OUT/step-N) instead of training to the end")
    ap.add_argument("--train-one", choices=("cot", "direct"), help=argparse.SUPPRESS)
    args = ap.parse_args()
    if args.train_one:
        return train_one(args)
    out = Path(args.out)
    corpora = write_corpora(out / "corpus", args.problems, args.seed)
    tokenizer = write_tokenizer(out / "tokenizer.json", corpora, args.vocab_size)
    for kind, corpus in corpora.items():
        prepare_shards(out / f"shards-{kind}", corpus, tokenizer)
    script = [sys.executable, os.path.abspath(__file__)] + sys.argv[1:]
    models = {kind: out / f"model-{kind}" for kind in corpora}
    if args.at_step:
        out = out / f"step-{args.at_step}"
        models = {kind: checkpoint_folder(model, args.at_step, out / f"model-{kind}") for kind, model in models.items()}
    else:
        run_all([(script + ["--out", str(out), "--train-one", kind], out / f"train-{kind}.log")
                 for kind in corpora if trained_steps(models[kind]) < args.steps])
    tasks = ",".join(f"addition_{p}_d{d}" for p in PROMPTS for d in DIGITS)
    run_all([([sys.executable, "-m", "lmkit", "harness", "--model", str(models[kind]), "--tasks", tasks,
               "--limit", str(args.limit), "--batch-size", "16", "--gen-kwargs", f"max_gen_toks={args.max_gen_toks}",
               "--output", str(out / f"harness-{kind}.json")], out / f"harness-{kind}.log")
             for kind in corpora if not (out / f"harness-{kind}.json").is_file()])
    scores = {kind: json.loads((out / f"harness-{kind}.json").read_text(encoding="utf-8"))["results"]
              for kind in corpora}
    table = results_table(scores)
    print(table)
    (out / "table.md").write_text(table + "\n", encoding="utf-8")


def results_table(scores: dict[str, dict]) -> str:
    """Markdown: one row per (trained on, prompt), strict / flexible exact match per number of digits."""
    head = "| trained on | prompt | " + " | ".join(f"{d} digit{'s' * (d > 1)}" for d in DIGITS) + " |"
    rows = [head, "| --- | --- |" + " ---: |" * len(DIGITS)]
    for kind, results in scores.items():
        for prompt, label in PROMPTS.items():
            if f"addition_{prompt}_d1" not in results:  # a results file from before the zero-shot tasks
                continue
            cells = []
            for d in DIGITS:
                r = results[f"addition_{prompt}_d{d}"]
                cells.append(f"{r['exact_match,strict-match']:.2f} / {r['exact_match,flexible-extract']:.2f}")
            trained = {"cot": "step-by-step traces", "direct": "answers alone"}[kind]
            rows.append(f"| {trained} | {label} | " + " | ".join(cells) + " |")
    return "\n".join(rows)


if __name__ == "__main__":
    main()
