"""`lmkit demo` (what `make demo` runs): train the default model on pydocs for about five minutes,
report validation loss, perplexity and bits per byte, and continue a few prompts; then instruction-tune it on
pydocs-instruct (ChatML, packed, about two and a half minutes), compare held-out SFT loss and answer ROUGE-L of
the base model (zero- and few-shot) and the tuned one, and hold a few chat turns."""
from __future__ import annotations

import argparse
import shutil
from pathlib import Path

import lmkit
from lmkit.atomic import atomic_write_text
from lmkit.cli.helptext import add_command
from lmkit.data import load_corpus
from lmkit.data.instruct import pydocs_instruct
from lmkit.errors import TrainingError

PROMPTS = ("Return the number of", "The ``with`` statement", "class ")

DEFAULT_OUT = "runs/demo"
MARK = ".lmkit-demo"  # marks a folder the demo made, so that the next demo may replace it


def register(subparsers) -> None:
    p = add_command(subparsers, "demo", help="train a small model on pydocs (~5 minutes), tune it to chat (~2.5) and "
                    "talk to it", description=__doc__, example_lines=(
                        "lmkit demo                                   # runs/demo and runs/demo/sft",
                        "lmkit demo --time-budget 60 --sft-budget 0 --out runs/quick"))
    p.add_argument("--out", default=DEFAULT_OUT, metavar="DIR", help="run folder, replaced on each demo (default runs/demo)")
    p.add_argument("--time-budget", type=float, default=300.0, metavar="SECONDS", help="training time (default 300)")
    p.add_argument("--sft-budget", type=float, default=150.0, metavar="SECONDS",
                   help="instruction-tuning time (default 150; 0 skips the stage)")
    p.add_argument("--seed", type=int, default=0, metavar="N", help="random seed (default 0)")
    p.set_defaults(func=run)


def run(args: argparse.Namespace) -> int:
    import torch

    from lmkit.cli.train import summary
    from lmkit.evaluate import evaluate_text
    from lmkit.train import TrainConfig, Trainer
    from lmkit.train.checkpoint import latest_checkpoint

    out = Path(args.out)
    if out.exists() and latest_checkpoint(out) is not None:
        if not (out / MARK).exists() and args.out != DEFAULT_OUT:  # someone's training run: never delete it
            raise TrainingError(f"{out} holds a training run that `lmkit demo` did not make; give the demo another "
                                "--out (it replaces its own folder on each run)")
        shutil.rmtree(out)  # the demo's own run folder from an earlier demo
    cfg = TrainConfig(preset="default", corpus=["pydocs"], out=str(out), time_budget=args.time_budget, seed=args.seed)
    print(f"lmkit demo: training the default model on pydocs for about {args.time_budget:.0f}s into {out}")
    trainer = Trainer(cfg)  # checks the settings first: a demo that cannot run leaves no folder
    atomic_write_text(out / MARK, "made by `lmkit demo`, which replaces this folder on each run\n")
    if trainer.sizing is not None:
        print(trainer.sizing.describe())
    print(f"{trainer.model.num_parameters() / 1e6:.2f}M parameters, vocabulary {trainer.model_config.vocab_size}, "
          f"{trainer.stream.num_tokens} training tokens, precision {trainer.cfg.precision}")
    print(summary(trainer.fit(), str(out)))

    model, tok = trainer.model.eval(), trainer.tokenizer
    _, val = load_corpus(["pydocs"]).split(trainer.cfg.val_fraction)
    r = evaluate_text(model, tok, val, precision="fp32")
    print(f"\nvalidation ({r['tokens']} tokens, {r['bytes']} bytes, fp32): loss {r['loss']:.4f} nats/token, "
          f"perplexity {r['perplexity']:.2f}, bits per byte {r['bpb']:.4f}\n")
    torch.manual_seed(args.seed)
    for prompt in PROMPTS:
        ids = torch.tensor([[trainer.bos_id] + tok.encode(prompt, add_special_tokens=False)])
        with torch.no_grad():
            gen = model.generate(ids, max_new_tokens=60, do_sample=True, temperature=0.8, top_k=40,
                                 eos_token_id=trainer.bos_id, pad_token_id=trainer.pad_id)
        text = tok.decode(gen[0, 1:].tolist(), skip_special_tokens=True)
        print(f"--- {prompt!r}\n{text}\n")
    print(f"try: lmkit generate --model {out} --prompt \"Return the\"    |    lmkit eval --model {out}")
    if args.sft_budget > 0:
        instruction_tune(out, args.sft_budget, args.seed, trainer.bos_id)
    return 0


EVAL_QUESTIONS = 30  # held-out pairs answered by each model (greedy) for ROUGE-L
EVAL_ROWS = 200  # held-out pairs scored for the SFT loss
SHOTS = 3


def instruction_tune(base: Path, budget: float | None, seed: int, bos_id: int, steps: int | None = None) -> dict:
    """SFT of the demo model on pydocs-instruct, the held-out comparison table, and a few chat turns; `steps`: a
    fixed step count in place of the time budget (with the budget's 10 warm-up steps), for a load-independent run."""
    from lmkit.chat_session import ChatSession
    from lmkit.finetune.sft import SFTConfig, evaluate_loss, resize_token_embeddings, sft
    from lmkit.finetune.sft_data import prepare
    from lmkit.finetune.sft_eval import answer_rouge

    tuned_dir = base / "sft"
    length = f"{steps} steps" if steps else f"about {budget:.0f}s"
    print(f"\nlmkit demo: instruction-tuning on pydocs-instruct (ChatML, packed) for {length} into {tuned_dir}")
    schedule = dict(max_steps=steps, warmup_ratio=10 / steps) if steps else dict(max_steps=100_000, time_budget=budget)
    r = sft(SFTConfig(model=str(base), train="pydocs-instruct", out=str(tuned_dir), chat_template="chatml",
                      packing=True, batch_size=16, lr=1e-3, seed=seed, log_every=50, **schedule), log=print)
    held = pydocs_instruct("validation")[:EVAL_QUESTIONS]
    shots = pydocs_instruct("train")[:: 997][:SHOTS]
    base_model, base_tok = lmkit.load_model(base), lmkit.load_tokenizer(base / "tokenizer.json")
    tuned, tok = lmkit.load_model(tuned_dir), lmkit.load_tokenizer(tuned_dir)
    rows, _ = prepare(tok, "pydocs-instruct:validation", tuned.config.max_seq_len)
    rows = rows[:EVAL_ROWS]
    pad = tok.token_to_id("<|im_end|>")
    loss_tuned = evaluate_loss(tuned, rows, pad)
    widened = lmkit.load_model(base)
    resize_token_embeddings(widened, tok.vocab_size)  # the ChatML rows at their initial value, the mean row
    loss_base = evaluate_loss(widened, rows, pad)
    zero, _ = answer_rouge(base_model, base_tok, held, chat=False, bos_id=bos_id)
    few, _ = answer_rouge(base_model, base_tok, held, chat=False, shots=shots, bos_id=bos_id)
    chat, answers = answer_rouge(tuned, tok, held, chat=True)
    print(f"\n{r['examples']} training pairs packed into {r['packed_rows']} rows, {r['steps']} steps in "
          f"{r['seconds']:.0f}s; held out: {len(rows)} pairs (loss) and {len(held)} questions (ROUGE-L, greedy) from "
          "pydocs' validation documents")
    print("| model | held-out SFT loss (nats/token) | answer ROUGE-L F1 |\n| --- | --- | --- |")
    print(f"| base, zero-shot | {loss_base:.3f} | {zero:.3f} |")
    print(f"| base, {SHOTS}-shot | (same) | {few:.3f} |")
    print(f"| instruction-tuned | {loss_tuned:.3f} | {chat:.3f} |\n")
    session = ChatSession(tuned, tok, max_new_tokens=48, temperature=0)
    for row in held[:3]:
        question = row["messages"][0]["content"]
        print(f"you> {question}\nassistant> {session.send(question)}")
        session.reset()
    print(f"\ntry: lmkit chat --model {tuned_dir}")
    return {"sft": r, "loss_base": loss_base, "loss_tuned": loss_tuned, "rouge_zero_shot": zero, "rouge_few_shot": few, "rouge_tuned": chat}
