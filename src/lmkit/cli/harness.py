"""`lmkit harness`: lm-evaluation-harness tasks on an lmkit folder, in process.

lmkit's offline tasks (pydoc_mc, numbers, numbers_1shot, numbers_5shot, addition_cot_d1..d4,
addition_direct_d1..d4, pydocs_perplexity; tags lmkit, addition_cot, addition_direct) need no
--include-path; lm-eval's own tasks work too where their data is on disk.
"""
from __future__ import annotations

import argparse
import sys

from lmkit.atomic import atomic_write_text
from lmkit.cli.helptext import add_command
from lmkit.cli.common import add_device_argument, device_of
from lmkit.errors import ConfigError


def register(subparsers) -> None:
    p = add_command(subparsers, "harness", help="run lm-evaluation-harness tasks on a model folder",
                    description=__doc__, example_lines=(
                        "lmkit harness --model runs/demo --tasks pydoc_mc,numbers",
                        "lmkit harness --model runs/demo/sft --tasks addition_cot --limit 50 --apply-chat-template",
                        "lmkit harness --model runs/demo --tasks pydoc_mc --bootstrap-iters 1000 --output results.json"))
    p.add_argument("--model", required=True, metavar="DIR", help="model folder (decoder-only or encoder-decoder)")
    p.add_argument("--tasks", required=True, metavar="T1,T2", help="comma-separated task, tag or group names")
    p.add_argument("--num-fewshot", type=int, metavar="K", help="exemplars in each prompt (default: each task's own)")
    p.add_argument("--apply-chat-template", action="store_true",
                   help="render prompts with the folder's chat template, exemplars as alternating turns (default: plain "
                        "text)")
    p.add_argument("--include-path", metavar="DIR", help="a folder of your own task YAML files (default: lmkit's and lm-eval's tasks only)")
    p.add_argument("--limit", type=float, metavar="N", help="at most N documents per task, below 1 a fraction (default: all)")
    p.add_argument("--batch-size", type=int, default=8, metavar="N", help="requests per forward pass (default 8)")
    p.add_argument("--bootstrap-iters", type=int, default=0, metavar="N",
                   help="bootstrap resamples for the Stderr column (default 0: off, faster, and Stderr reads N/A; "
                        "lm-eval's own default is 100000)")
    p.add_argument("--gen-kwargs", metavar="K=V,...", help="generation settings over the tasks' (e.g. max_gen_toks=32; default: each task's own)")
    p.add_argument("--output", metavar="FILE", help="write lm-eval's results JSON here (default: the table only)")
    add_device_argument(p)
    p.set_defaults(func=run)


def run(args: argparse.Namespace) -> int:
    from lmkit.evaluate.harness_run import require_lm_eval

    if args.num_fewshot is not None and args.num_fewshot < 0:
        raise ConfigError(f"--num-fewshot must be 0 or more, got {args.num_fewshot}")
    if args.batch_size < 1:
        raise ConfigError(f"--batch-size must be at least 1, got {args.batch_size}")
    if args.bootstrap_iters < 0:
        raise ConfigError(f"--bootstrap-iters must be 0 or more, got {args.bootstrap_iters}")
    if args.limit is not None and args.limit <= 0:
        raise ConfigError(f"--limit must be above 0, got {args.limit:g}")
    require_lm_eval()
    import logging

    from lmkit.evaluate import harness_run

    logging.getLogger("lm_eval").setLevel(logging.ERROR)  # its per-task notices would bury the table

    tasks = [t.strip() for t in args.tasks.split(",") if t.strip()]
    limit = int(args.limit) if args.limit is not None and args.limit >= 1 else args.limit
    results = harness_run.run(args.model, tasks, num_fewshot=args.num_fewshot,
                              apply_chat_template=args.apply_chat_template, include_path=args.include_path,
                              limit=limit, batch_size=args.batch_size, device=device_of(args), gen_kwargs=args.gen_kwargs,
                              bootstrap_iters=args.bootstrap_iters)
    print(harness_run.results_table(results))
    if args.bootstrap_iters == 0:
        print("lmkit: Stderr is N/A: no bootstrap by default (it takes long); --bootstrap-iters 1000 estimates it",
              file=sys.stderr)
    if args.output:
        atomic_write_text(args.output, harness_run.results_json(results) + "\n")
        print(f"results written to {args.output}")
    return 0
