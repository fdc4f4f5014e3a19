"""The preference-tuning tasks of `lmkit finetune`: --task dpo (DPO against a frozen reference) and --task reward
(a Bradley-Terry reward model), their flags and their one-line reports."""
from __future__ import annotations

import argparse

from lmkit.errors import ConfigError

DPO_ONLY = (("--ref-model", "ref_model"), ("--beta", "beta"), ("--loss-type", "loss_type"),
            ("--label-smoothing", "label_smoothing"), ("--precompute-ref", "precompute_ref"))
REWARD_ONLY = (("--center-rewards", "center_rewards"),)
SHARED = (("--max-prompt-length", "max_prompt_length"),)
NOT_HERE = (("--pooling", "pooling"), ("--val-fraction", "val_fraction"), ("--packing", "packing"),
            ("--train-on-all", "train_on_all"))


def add_alignment_arguments(parser) -> None:
    g = parser.add_argument_group("--task dpo and --task reward (rows {\"prompt\", \"chosen\", \"rejected\"}, "
                                  "text or messages); --beta, --loss-type and --max-prompt-length serve --task grpo too")
    g.add_argument("--ref-model", metavar="DIR", help="dpo: the frozen reference (default: a copy of --model; with "
                   "--peft lora, --model with its adapters disabled)")
    g.add_argument("--beta", type=float, metavar="X", help="dpo: the KL strength beta (default 0.1, TRL's); grpo: the "
                   "weight of the KL penalty to the starting model (default 0.0, TRL's: no reference model is held)")
    g.add_argument("--loss-type", metavar="NAME", help="dpo: sigmoid, ipo, hinge or robust (default sigmoid); grpo: "
                   "grpo, bnpo, dr_grpo or dapo, how the per-token loss is normalised (default dapo, TRL's)")
    g.add_argument("--label-smoothing", type=float, metavar="F", help="dpo --loss-type robust: the share of flipped "
                   "labels assumed, in [0, 0.5) (default 0)")
    g.add_argument("--precompute-ref", action="store_true", help="dpo: score the data with the reference once before "
                   "training and free it (default: a reference forward every step)")
    g.add_argument("--max-prompt-length", type=int, metavar="N", help="refuse a row (grpo: a prompt) whose prompt passes "
                   "N tokens (default: none; dpo/reward: a prompt that fills --max-length is always refused)")
    g.add_argument("--center-rewards", type=float, metavar="X", help="reward: TRL's center_rewards_coefficient, "
                   "X mean((r_chosen + r_rejected)^2) added to the loss (default: none)")


def refuse(args: argparse.Namespace, pairs, task: str) -> None:
    given = [flag for flag, name in pairs if getattr(args, name, None) not in (None, False)]
    if given:
        raise ConfigError(f"{', '.join(given)} does not apply to --task {task}; drop it")


def check_flags(args: argparse.Namespace) -> None:
    """Refuse the preference flags on the tasks that do not read them."""
    if args.task not in ("dpo", "reward"):
        refuse(args, DPO_ONLY + REWARD_ONLY + SHARED, args.task)
    elif args.task == "dpo":
        refuse(args, REWARD_ONLY + NOT_HERE, "dpo")
    else:
        refuse(args, DPO_ONLY + NOT_HERE, "reward")


def run(args: argparse.Namespace, method: str, settings: dict, run_settings: dict, on_every_rank) -> int:
    """--task dpo or reward; `run_settings` and `on_every_rank` are `lmkit finetune`'s (the loop's flags, torchrun)."""
    fields = common_fields(args, method, settings, run_settings)
    return (run_dpo if args.task == "dpo" else run_reward)(args, fields, on_every_rank)


def common_fields(args: argparse.Namespace, method: str, settings: dict, run_settings: dict) -> dict:
    fields = dict(model=args.model, train=args.train, out=args.out, eval=args.eval, max_length=args.max_length,
                  max_prompt_length=args.max_prompt_length, chat_template=args.chat_template, epochs=args.epochs or 1,
                  max_steps=args.max_steps, batch_size=args.batch_size or 8, micro_batch_size=args.micro_batch_size,
                  seed=args.seed, peft=method, peft_settings=settings if method != "full" else {}, **run_settings)
    for key in ("lr", "warmup_ratio", "weight_decay"):
        if getattr(args, key) is not None:
            fields[key] = getattr(args, key)
    return fields


def run_dpo(args: argparse.Namespace, fields: dict, on_every_rank) -> int:
    from lmkit.cli.common import device_of
    from lmkit.finetune.dpo import DPOConfig, dpo

    for key in ("ref_model", "beta", "loss_type", "label_smoothing"):
        if getattr(args, key) is not None:
            fields[key] = getattr(args, key)
    log = lambda line: print(f"lmkit finetune --task dpo: {line}", flush=True)  # noqa: E731
    r, status = on_every_rank(lambda: dpo(DPOConfig(precompute_ref=args.precompute_ref, **fields), log=log),
                              device_of(args))
    if r is None:
        return status
    m = r["last_metrics"]
    held = ""
    if r["eval_after"] is not None:
        b, a = r["eval_before"], r["eval_after"]
        held = (f"; held-out preference accuracy {b['accuracy']:.3f} -> {a['accuracy']:.3f}, loss {b['loss']:.4f} -> "
                f"{a['loss']:.4f}")
    left = f" ({r['dropped']} built-in rows whose prompt fills --max-length left out)" if r.get("dropped") else ""
    print(f"lmkit finetune --task dpo: {r['pairs']} pairs{left}, {r['steps']} steps, last loss {r['last_loss']:.4f}, reward "
          f"accuracy {m['rewards/accuracies']:.3f}, margin {m['rewards/margins']:.4f}{held}; saved to {args.out}")
    return 0


def run_reward(args: argparse.Namespace, fields: dict, on_every_rank) -> int:
    from lmkit.cli.common import device_of
    from lmkit.finetune.reward import RewardConfig, train_reward_model

    log = lambda line: print(f"lmkit finetune --task reward: {line}", flush=True)  # noqa: E731
    r, status = on_every_rank(lambda: train_reward_model(RewardConfig(center_rewards=args.center_rewards, **fields),
                                                         log=log), device_of(args))
    if r is None:
        return status
    held = ""
    if r["eval_after"] is not None:
        b, a = r["eval_before"], r["eval_after"]
        held = f"; held-out preference accuracy {b['accuracy']:.3f} -> {a['accuracy']:.3f}"
    print(f"lmkit finetune --task reward: {r['pairs']} pairs ({r['dropped']} longer than --max-length dropped), "
          f"{r['steps']} steps, last loss {r['last_loss']:.4f}, accuracy {r['last_metrics']['accuracy']:.3f}{held}; "
          f"saved to {args.out}")
    return 0
