"""`lmkit demo` (what `make demo` runs): train the default model on pydocs for about five minutes,
report validation loss, perplexity and bits per byte, and continue a few prompts."""
from __future__ import annotations

import argparse
import shutil
from pathlib import Path

PROMPTS = ("Return the number of", "The ``with`` statement", "class ")

DEFAULT_OUT = "runs/demo"
MARK = ".lmkit-demo"  # marks a folder the demo made, so that the next demo may replace it


def register(subparsers) -> None:
    p = subparsers.add_parser("demo", help="train a small model on pydocs for ~5 minutes and sample from it",
                              description=__doc__)
    p.add_argument("--out", default=DEFAULT_OUT, metavar="DIR", help="run folder, replaced on each demo (default runs/demo)")
    p.add_argument("--time-budget", type=float, default=300.0, metavar="SECONDS", help="training time (default 300)")
    p.add_argument("--seed", type=int, default=0, metavar="N")
    p.set_defaults(func=run)


def run(args: argparse.Namespace) -> int:
    import torch

    from lmkit.cli.train import summary
    from lmkit.data import load_corpus
    from lmkit.evaluate import evaluate_text
    from lmkit.train import TrainConfig, Trainer
    from lmkit.atomic import atomic_write_text
    from lmkit.errors import TrainingError
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
    return 0
