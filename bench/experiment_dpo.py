"""Issue 35's Experiment 2: DPO on the demo's instruction-tuned model at two betas, on the built-in
`pydocs-preference` pairs (chosen = the reference answer, rejected = another symbol's answer of the same kind).

Trains the demo recipe for fixed step counts (the default preset on pydocs, then the demo's SFT stage on
pydocs-instruct, as bench/demo_fixed_steps.py; skipped when OUT/sft exists), then from that SFT model one DPO run
per beta (sigmoid loss, the SFT model as the frozen reference). For the SFT model and each DPO model it reports:
held-out preference accuracy (implicit reward margin beta (log pi/ref(chosen) - log pi/ref(rejected)) > 0) and the
mean margin on --held pairs of pydocs-preference's validation split, held-out SFT loss on pydocs-instruct's
validation pairs, and ROUGE-L F1 and mean length (words) of greedy answers to held-out questions.

    nice -n 10 python bench/experiment_dpo.py [--out runs/experiment-dpo] [--steps 200] [--sft-steps 100]
        [--dpo-steps 40] [--betas 0.1 0.5] [--lr 1e-5] [--held 200] [--questions 30]
"""
from __future__ import annotations

import argparse
import json
import time
from pathlib import Path


def held_pairs(path: Path, n: int) -> None:
    """The first n pairs of pydocs-preference's validation split as a JSONL file (the DPO job's --eval)."""
    from lmkit.atomic import atomic_write_text
    from lmkit.data.instruct import pydocs_preference

    rows = [{k: r[k] for k in ("prompt", "chosen", "rejected")} for r in pydocs_preference("validation")[:n]]
    atomic_write_text(path, "".join(json.dumps(r) + "\n" for r in rows))


def answers(folder: Path, questions: int, held_rows: int) -> dict:
    """Held-out SFT loss and greedy answers' ROUGE-L F1 and length of the chat model in `folder`."""
    import lmkit
    from lmkit.data.instruct import pydocs_instruct
    from lmkit.finetune.sft import evaluate_loss
    from lmkit.finetune.sft_data import prepare
    from lmkit.finetune.sft_eval import answer_rouge

    model, tok = lmkit.load_model(folder).eval(), lmkit.load_tokenizer(folder)
    rows = prepare(tok, "pydocs-instruct:validation", model.config.max_seq_len)[0][:held_rows]
    loss = evaluate_loss(model, rows, tok.token_to_id("<|im_end|>"))
    rouge, said = answer_rouge(model, tok, pydocs_instruct("validation")[:questions], chat=True)
    return {"sft_loss": loss, "rouge_l": rouge, "answer_words": sum(len(a.split()) for a in said) / len(said),
            "example": said[0]}


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--out", default="runs/experiment-dpo")
    ap.add_argument("--steps", type=int, default=200, help="pre-training steps of the demo recipe")
    ap.add_argument("--sft-steps", type=int, default=100)
    ap.add_argument("--dpo-steps", type=int, default=40)
    ap.add_argument("--betas", type=float, nargs="+", default=[0.1, 0.5])
    ap.add_argument("--lr", type=float, default=1e-5)
    ap.add_argument("--batch", type=int, default=8, help="pairs per DPO step")
    ap.add_argument("--held", type=int, default=200, help="held-out preference pairs (and SFT rows) scored")
    ap.add_argument("--questions", type=int, default=30, help="held-out questions answered (ROUGE-L)")
    ap.add_argument("--seed", type=int, default=0)
    args = ap.parse_args()

    from lmkit.finetune.dpo import DPOConfig, dpo

    out, start = Path(args.out), time.perf_counter()
    sft_dir = out / "sft"
    if not (sft_dir / "config.json").exists():
        from lmkit.cli.demo import instruction_tune
        from lmkit.train import TrainConfig, Trainer

        trainer = Trainer(TrainConfig(preset="default", corpus=["pydocs"], out=str(out), max_steps=args.steps,
                                      seed=args.seed))
        trainer.fit()
        instruction_tune(trainer.out, None, args.seed, trainer.bos_id, steps=args.sft_steps)
        print(f"demo models trained in {time.perf_counter() - start:.0f} s", flush=True)
    held = out / "held-pairs.jsonl"
    held_pairs(held, args.held)
    results = {"settings": vars(args), "sft": answers(sft_dir, args.questions, args.held)}
    for beta in args.betas:
        t = time.perf_counter()
        report = dpo(DPOConfig(model=str(sft_dir), train="pydocs-preference", eval=str(held), out=str(out / f"dpo-b{beta}"),
                               beta=beta, lr=args.lr, max_steps=args.dpo_steps, batch_size=args.batch, seed=args.seed,
                               log_every=10), log=print)
        results[f"beta {beta}"] = {"eval_before": report["eval_before"], "eval_after": report["eval_after"],
                                   "train_last": report["last_metrics"], "seconds": time.perf_counter() - t,
                                   **answers(out / f"dpo-b{beta}", args.questions, args.held)}
        print(json.dumps(results[f"beta {beta}"], indent=1), flush=True)
    (out / "experiment_dpo.json").write_text(json.dumps(results, indent=2), encoding="utf-8")
    sft = results["sft"]
    print(f"\n{args.dpo_steps} DPO steps of {args.batch} pairs, lr {args.lr}; held out: {args.held} pairs, "
          f"{args.questions} questions")
    print("| model | pref. accuracy | margin | margin / beta | held-out SFT loss | ROUGE-L F1 | answer words |")
    print("| --- | ---: | ---: | ---: | ---: | ---: | ---: |")
    before = results[f"beta {args.betas[0]}"]["eval_before"]
    print(f"| SFT (policy = reference) | {before['accuracy']:.3f} | {before['margin']:.3f} | 0 | {sft['sft_loss']:.3f} | "
          f"{sft['rouge_l']:.3f} | {sft['answer_words']:.1f} |")
    for beta in args.betas:
        r = results[f"beta {beta}"]
        print(f"| DPO beta {beta} | {r['eval_after']['accuracy']:.3f} | {r['eval_after']['margin']:.3f} | "
              f"{r['eval_after']['margin'] / beta:.2f} | {r['sft_loss']:.3f} | {r['rouge_l']:.3f} | {r['answer_words']:.1f} |")
    print(f"all done in {time.perf_counter() - start:.0f} s")


if __name__ == "__main__":
    main()
