"""`lmkit finetune --task grpo`: its flags and its run (the shared fine-tuning flags come from cli/finetune.py)."""
from __future__ import annotations

import argparse

from lmkit.errors import ConfigError

# flags of other tasks that mean nothing to GRPO
NOT_GRPO = (("--train", "train"), ("--eval", "eval"), ("--epochs", "epochs"), ("--pooling", "pooling"),
            ("--val-fraction", "val_fraction"), ("--max-length", "max_length"), ("--packing", "packing"),
            ("--chat-template", "chat_template"), ("--train-on-all", "train_on_all"),
            ("--micro-batch-size", "micro_batch_size"))


# the --task grpo flags by argparse name: None when not given (other tasks refuse them; GRPOConfig has the defaults)
GRPO_FLAGS = ("prompts", "reward", "num_generations", "num_iterations", "beta", "epsilon", "epsilon_high", "temperature", "top_p", "top_k",
              "max_completion_length", "max_prompt_length", "loss_type", "scale_rewards")
GRPO_ONLY = tuple(("--" + name.replace("_", "-"), name) for name in GRPO_FLAGS)
# flags --task dpo defines and GRPO reads too (one definition, in finetune_align's group)
SHARED_WITH_DPO = ("beta", "loss_type", "max_prompt_length")
# preference-tuning flags that mean nothing to GRPO
NOT_FOR_GRPO = (("--ref-model", "ref_model"), ("--label-smoothing", "label_smoothing"),
                ("--precompute-ref", "precompute_ref"), ("--center-rewards", "center_rewards"))


def add_grpo_arguments(parser) -> None:
    g = parser.add_argument_group("--task grpo (reinforcement learning with verifiable rewards, as TRL's GRPOTrainer)")
    g.add_argument("--prompts", metavar="FILE", help="prompts: .jsonl rows {\"prompt\": text or messages, other columns "
                   "passed to the reward}, or addition-cot (the harness's addition problems, answer column); required by --task grpo (default: none)")
    g.add_argument("--reward", metavar="NAME", help="exact-answer (the number after \"The answer is\" equals the row's "
                   "answer), regex:PATTERN, MODULE:FUNCTION (TRL's signature f(prompts, completions, **columns), run "
                   "in a worker process), or a reward model folder; required by --task grpo (default: none)")
    g.add_argument("--num-generations", type=int, metavar="N", help="completions sampled per prompt "
                   "(default 8); --batch-size counts completions, a multiple of it")
    g.add_argument("--num-iterations", type=int, metavar="N", help="optimizer steps on each generation of completions, "
                   "the ratio taken against the policy that sampled them (default 1, TRL's)")
    g.add_argument("--epsilon", type=float, metavar="X", help="clip range of the ratio (default 0.2)")
    g.add_argument("--epsilon-high", type=float, metavar="X", help="upper clip range (default: --epsilon)")
    g.add_argument("--temperature", type=float, metavar="T", help="sampling temperature of the rollouts, "
                   "also applied to the trained log-probabilities (default 1.0)")
    g.add_argument("--top-p", type=float, metavar="P", help="nucleus sampling mass (default 1.0: off)")
    g.add_argument("--top-k", type=int, metavar="K", help="sample among the K likeliest tokens (default 0: off)")
    g.add_argument("--max-completion-length", type=int, metavar="N", help="tokens per completion (default 512, or what "
                   "fits the model's positions after the longest prompt)")
    g.add_argument("--scale-rewards", choices=["group", "batch", "none"],
                   help="divide advantages by the std of the group, of the batch, or not (default group)")


def run_grpo(args: argparse.Namespace, settings: dict) -> int:
    from lmkit.finetune.grpo import GRPOConfig, grpo

    given = [flag for flag, name in NOT_GRPO if getattr(args, name) not in (None, False)]
    if given:
        raise ConfigError(f"{', '.join(given)} {'does' if len(given) == 1 else 'do'} not apply to --task grpo; "
                          "give its prompts with --prompts FILE and its reward with --reward")
    if not args.prompts or not args.reward:
        raise ConfigError("--task grpo needs --prompts FILE.jsonl (or addition-cot) and --reward NAME|MODULE:FUNCTION|DIR")
    if args.peft != "full":
        raise ConfigError("--task grpo trains the full model; drop --peft")
    fields = dict(model=args.model, out=args.out, max_steps=args.max_steps, seed=args.seed, **settings)
    for name in GRPO_FLAGS + ("batch_size", "lr", "warmup_ratio", "weight_decay"):
        if getattr(args, name) is not None:  # else GRPOConfig's default, TRL's
            fields[name] = getattr(args, name)
    log = lambda line: print(f"lmkit finetune --task grpo: {line}", flush=True)  # noqa: E731
    r = grpo(GRPOConfig(**fields), log=log)
    first = "n/a" if r["first_reward"] is None else f"{r['first_reward']:.4f}"
    last = "n/a" if r["last_reward"] is None else f"{r['last_reward']:.4f}"
    print(f"lmkit finetune --task grpo: {r['steps']} steps over {r['prompts']} prompts in {r['seconds']:.0f} s; "
          f"mean reward {first} -> {last}; saved to {args.out}")
    return 0
