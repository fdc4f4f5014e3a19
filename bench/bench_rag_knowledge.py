"""Knowledge without retraining: a small decoder trained to answer from retrieved sources, on a synthetic world.

    OMP_NUM_THREADS=1 python bench/bench_rag_knowledge.py [--entities 1500] [--steps 1000] [--mode hybrid] [--out DIR]

`lmkit.rag.world` draws entities with invented names and three attributes (10 values each: chance 10%).
Facts of the first 60% of entities ("train") and the next 25% ("held out") are indexed with
all-MiniLM-L6-v2. A decoder (lmkit CausalLM from scratch, 2 layers of width 128 by default) and a byte-level
BPE tokenizer trained on the world's texts are saved as a folder and fine-tuned by lmkit's SFT
(`lmkit.finetune.sft`, what `lmkit finetune --task sft` runs) on prompt/completion rows, the loss on the
completion only: the prompt is what `lmkit rag ask` writes (numbered sources, k = 3, retrieved by --mode,
then the question; without its instruction line unless --with-instruction, which keeps steps short), the
completion "VALUE [n]"; every train fact is also a closed-book row (no sources, completion
"VALUE"). Many entities make memorising every fact harder than learning to copy the value from the
sources. The step count is fixed (not a time budget), so the result does not depend on the machine's load.

The tuned model is then asked, greedy, with the same retrieval (--mode; hybrid by default, as `rag ask`):
train facts, held-out facts (never trained on), both closed-book, facts of new entities added to the index
after training, and held-out and train facts whose value was changed in the index (exact match on the new
value and on the old one). Exact match is on VALUE, the answer's text before its first " [".
"""
from __future__ import annotations

import argparse
import json
import random
import tempfile
import time
from pathlib import Path

import torch


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--entities", type=int, default=1500)
    p.add_argument("--steps", type=int, default=1000, help="optimizer steps of the SFT run (fixed, not timed)")
    p.add_argument("--batch-size", type=int, default=16)
    p.add_argument("--questions", type=int, default=200, help="questions asked per row of the table, at most")
    p.add_argument("--lr", type=float, default=2e-3)
    p.add_argument("--warmup-ratio", type=float, default=0.05)
    p.add_argument("--vocab-size", type=int, default=1000)
    p.add_argument("--width", type=int, default=128)
    p.add_argument("--layers", type=int, default=2)
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--threads", type=int, default=1, help="torch threads (1: a modest share of a shared machine)")
    p.add_argument("--with-instruction", action="store_true",
                   help="put `rag ask`'s instruction line in every prompt (longer prompts, slower steps)")
    p.add_argument("--mode", default="hybrid", choices=("bm25", "dense", "hybrid"),
                   help="retrieval of the training prompts' sources and of the questions asked")
    p.add_argument("--ask-only", action="store_true",
                   help="with --out of an earlier run of the same settings: ask its tuned model, no training")
    p.add_argument("--out", help="keep the tuned model and the results (results.json) in this folder")
    args = p.parse_args()
    torch.set_num_threads(args.threads)
    import all_minilm_l6_v2

    import lmkit
    from lmkit.config import get_preset
    from lmkit.finetune.sft import SFTConfig, sft
    from lmkit.models import CausalLM
    from lmkit.rag import RagIndex, retrieve
    from lmkit.rag.answer import INSTRUCTION, citations, grounded_prompt, user_message
    from lmkit.rag.world import ATTRIBUTES, changed, world
    from lmkit.train.config import default_precision

    instruction = INSTRUCTION if args.with_instruction else ""
    torch.manual_seed(args.seed)
    rng = random.Random(args.seed)
    work = Path(args.out) if args.out else Path(tempfile.mkdtemp(prefix="rag-knowledge-"))
    work.mkdir(parents=True, exist_ok=True)
    facts = world(args.entities, args.seed)
    people = list(dict.fromkeys(f.name for f in facts))
    cut1, cut2 = int(0.6 * len(people)), int(0.85 * len(people))
    group = {name: ("train" if i < cut1 else "held" if i < cut2 else "late") for i, name in enumerate(people)}
    train = [f for f in facts if group[f.name] == "train"]
    held = [f for f in facts if group[f.name] == "held"]
    late = [f for f in facts if group[f.name] == "late"]

    encoder_dir = all_minilm_l6_v2.extract_model(tempfile.mkdtemp(prefix="minilm-"))
    dtype = torch.bfloat16 if default_precision() == "bf16" else None
    t = time.perf_counter()
    index = RagIndex.create(encoder_dir, chunk_tokens=64, overlap=0, dtype=dtype)
    index.add([f.document() for f in train + held])
    print(f"indexed {len(index)} facts in {time.perf_counter() - t:.0f} s", flush=True)

    # the tokenizer sees every text the prompts are made of, so values and name syllables become whole tokens
    texts = [f.document().text for f in facts] + [f.question() for f in facts] + [f.id for f in facts]
    texts += [INSTRUCTION] * 50 + [user_message(f.question(), [], instruction) for f in facts[:50]]
    texts += [f"{f.value} [{n}]" for f in facts for n in (1, 2, 3)]
    tok = lmkit.train_tokenizer(texts, kind="bpe", vocab_size=args.vocab_size, special_tokens=["<|endoftext|>"])
    eos = tok.token_to_id("<|endoftext|>")
    tok.eos_token_id = tok.pad_token_id = eos

    rows = []
    for f in train:
        hits = retrieve(index, f.question(), 3, args.mode)
        gold = next((n for n, h in enumerate(hits, 1) if h.source == f.id), None)
        if gold is not None:
            rows.append({"prompt": grounded_prompt(tok, f.question(), hits, instruction)[0], "completion": f" {f.value} [{gold}]"})
        rows.append({"prompt": grounded_prompt(tok, f.question(), [], instruction)[0], "completion": f" {f.value}"})
    (work / "train.jsonl").write_text("".join(json.dumps(r) + "\n" for r in rows), encoding="utf-8")
    longest = max(len(tok.encode(r["prompt"] + r["completion"])) for r in rows)
    cfg = get_preset("tiny", vocab_size=tok.vocab_size, d_model=args.width, n_layers=args.layers, n_heads=4,
                     max_seq_len=max(256, longest + 64), bos_token_id=eos, eos_token_id=eos, pad_token_id=eos)
    base = work / "base"
    CausalLM(cfg).save_pretrained(base)
    tok.save_pretrained(base)
    print(f"{len(rows)} SFT rows (longest {longest} tokens), {len(train)} train facts; "
          f"{sum(p.numel() for p in CausalLM(cfg).parameters()):,} parameters", flush=True)
    if args.ask_only and (work / "tuned" / "sft.json").is_file():
        report = json.loads((work / "tuned" / "sft.json").read_text(encoding="utf-8"))
        print(f"asking the model {work / 'tuned'} tuned by an earlier run")
    else:
        report = sft(SFTConfig(model=str(base), train=str(work / "train.jsonl"), out=str(work / "tuned"),
                               max_steps=args.steps, batch_size=args.batch_size, lr=args.lr,
                               warmup_ratio=args.warmup_ratio, seed=args.seed, log_every=250),
                     log=lambda line: print(line, flush=True))
    print(f"trained {report['steps']} steps in {report['seconds']:.0f} s (last loss {report['last_loss']:.3f})")
    model = lmkit.load_model(work / "tuned").eval()
    tok = lmkit.load_tokenizer(work / "tuned")

    def ask(questions, with_sources: bool):
        out = []
        for question in questions:
            hits = retrieve(index, question, 3, args.mode) if with_sources else []
            ids = grounded_prompt(tok, question, hits, instruction)[1]
            with torch.inference_mode():
                gen = model.generate(torch.tensor([ids]), max_new_tokens=8, do_sample=False, eos_token_id=eos,
                                     pad_token_id=eos)
            out.append((tok.decode(gen[0, len(ids):].tolist(), skip_special_tokens=True).strip(), hits))
        return out

    def value(reply: str) -> str:
        return reply.split(" [")[0].strip()

    def exact(results, wanted):
        return sum(value(r) == w.value for (r, _), w in zip(results, wanted)) / max(len(wanted), 1)

    def recall(results, wanted):
        return sum(any(h.source == w.id for h in hits) for (_, hits), w in zip(results, wanted)) / max(len(wanted), 1)

    table = []

    def row(name, results, wanted, retrieved=True, old=None):
        table.append({"questions": f"{name} ({len(wanted)})", "exact_match": exact(results, wanted),
                      "gold_retrieved": recall(results, wanted) if retrieved else None,
                      "old_value": exact(results, old) if old is not None else None})

    counts = f"{len(train)} train, {len(held)} held-out, {len(late)} added facts"
    sample_train = rng.sample(train, min(args.questions, len(train)))
    held = rng.sample(held, min(args.questions, len(held)))
    row("train facts, with retrieval", ask([f.question() for f in sample_train], True), sample_train)
    res = ask([f.question() for f in held], True)
    row("held-out facts, with retrieval", res, held)
    cite = sum(bool(citations(r, len(h))) and h[citations(r, len(h))[0] - 1].source == w.id
               for (r, h), w in zip(res, held)) / len(held)
    row("held-out facts, closed-book", ask([f.question() for f in held], False), held, retrieved=False)
    row("train facts, closed-book", ask([f.question() for f in sample_train], False), sample_train, retrieved=False)
    index.add([f.document() for f in late])
    late_asked = rng.sample(late, min(args.questions, len(late)))
    row("facts of entities added to the index after training", ask([f.question() for f in late_asked], True),
        late_asked)
    before = held[: len(held) // 2]
    moved = [changed(f, args.seed) for f in before]
    index.add([f.document() for f in moved])
    row("held-out facts changed in the index", ask([f.question() for f in moved], True), moved, old=before)
    before = sample_train[: len(sample_train) // 2]
    moved = [changed(f, args.seed) for f in before]
    index.add([f.document() for f in moved])
    row("train facts changed in the index", ask([f.question() for f in moved], True), moved, old=before)

    chance = 1 / len(next(iter(ATTRIBUTES.values())))
    print(f"\nchance: {chance:.0%}; {counts} (at most {args.questions} questions asked per row)\n")
    print("| questions | exact match | gold fact retrieved (top 3) | answers with the old value |\n"
          "| --- | --- | --- | --- |")
    for r in table:
        cells = [f"{r['exact_match']:.1%}"] + ["" if r[k] is None else f"{r[k]:.1%}"
                                              for k in ("gold_retrieved", "old_value")]
        print(f"| {r['questions']} | {' | '.join(cells)} |")
    print(f"\nheld-out answers whose first citation is the gold fact: {cite:.1%}")
    results = {"args": vars(args), "table": table, "held_out_cited_gold": cite, "sft": report}
    (work / "results.json").write_text(json.dumps(results, indent=2), encoding="utf-8")
    print(f"results and the tuned model: {work}")


if __name__ == "__main__":
    main()
