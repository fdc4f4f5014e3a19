"""GRPO's reward functions, each f(prompts, completions, completion_ids, **columns) -> one float per completion
(TRL's signature; None: the completion cannot be scored, and gets advantage 0):

- built-in names: `exact-answer` (1 when the number after "The answer is" equals the row's "answer" column),
  `regex:PATTERN` (1 when PATTERN occurs in the completion);
- MODULE:FUNCTION (or FILE.py:FUNCTION): the user's function, run in a worker process (`reward_worker.py`), never in lmkit's own;
- a folder: a reward model (transformers' ...ForSequenceClassification with num_labels=1), its score of
  prompt + completion.

`checked` turns a function's answer into floats, or a RewardError naming the function and the row.
"""
from __future__ import annotations

import json
import math
import os
import re
import subprocess
import sys
from pathlib import Path

from lmkit.errors import ConfigError, RewardError

ANSWER = re.compile(r"The answer is (\-?[0-9]+)")  # the strict-match filter of the harness's addition tasks
BUILTIN_REWARDS = ("exact-answer", "regex:PATTERN")


def exact_answer(prompts, completions, answer, **_) -> list[float]:
    """1.0 where the first number after "The answer is" equals the row's answer, else 0.0."""
    out = []
    for completion, expected in zip(completions, answer):
        text = completion if isinstance(completion, str) else completion[-1]["content"]
        found = ANSWER.search(text)
        out.append(float(found is not None and found.group(1) == str(expected).strip()))
    return out


class Regex:
    """1.0 where the pattern occurs in the completion, else 0.0."""

    def __init__(self, pattern: str):
        try:
            self.pattern = re.compile(pattern)
        except re.error as exc:
            raise ConfigError(f"--reward regex:{pattern}: not a regular expression ({exc}); fix the pattern") from None

    def __call__(self, prompts, completions, **_) -> list[float]:
        return [float(self.pattern.search(c if isinstance(c, str) else c[-1]["content"]) is not None)
                for c in completions]


class WorkerFunction:
    """A user's MODULE:FUNCTION in a worker process, called over JSON lines on its stdin and stdout."""

    def __init__(self, spec: str):
        module, _, name = spec.rpartition(":")
        if not module or not name.isidentifier():
            raise ConfigError(f"--reward {spec}: give MODULE:FUNCTION (a module importable from the working "
                              f"directory) or FILE.py:FUNCTION, a reward model folder or one of "
                              f"{', '.join(BUILTIN_REWARDS)}")
        self.name = spec
        env = {**os.environ, "PYTHONPATH": os.pathsep.join(filter(None, [os.getcwd(), os.environ.get("PYTHONPATH")]))}
        # -P: the worker's own folder (lmkit/finetune) stays off the path, so no module there shadows the stdlib
        self.process = subprocess.Popen([sys.executable, "-P", str(Path(__file__).with_name("reward_worker.py")), spec],
                                        stdin=subprocess.PIPE, stdout=subprocess.PIPE, text=True, encoding="utf-8",
                                        env=env)
        first = self._answer()
        if "error" in first:
            self.close()
            raise ConfigError(f"--reward {spec}: cannot load the function ({first['error']}); give MODULE:FUNCTION "
                              "importable from the working directory")

    def _answer(self) -> dict:
        line = self.process.stdout.readline()
        if not line:
            code = self.process.wait()
            raise RewardError(f"reward {self.name}: its worker process ended (exit code {code}) without an answer; "
                              "a reward function must return, not exit")
        return json.loads(line)

    def __call__(self, prompts, completions, completion_ids, **columns) -> list:
        request = {"prompts": prompts, "completions": completions, "completion_ids": completion_ids,
                   "columns": columns}
        try:
            self.process.stdin.write(json.dumps(request) + "\n")
            self.process.stdin.flush()
        except BrokenPipeError:
            pass  # _answer reports the ended worker
        answer = self._answer()
        if "error" in answer:
            row = answer.get("row")
            where = f"on row {row}" if row is not None else "on the batch (every row alone passes)"
            raise RewardError(f"reward {self.name} raised {where}: {answer['error']}")
        return answer["rewards"]

    def close(self) -> None:
        if self.process.poll() is None:
            self.process.stdin.close()
            try:
                self.process.wait(timeout=10)
            except subprocess.TimeoutExpired:
                self.process.kill()
                self.process.wait()


def load_reward(spec: str):
    """The reward function `--reward spec` names (see the module docstring)."""
    if spec == "exact-answer":
        function = exact_answer
    elif spec.startswith("regex:"):
        function = Regex(spec[len("regex:"):])
    elif Path(spec).is_dir():
        from lmkit.finetune.reward_model import RewardModel

        function = RewardModel(spec)
    else:
        function = WorkerFunction(spec)
    return function


def checked(name: str, values, n: int, rows: list[str]) -> list[float]:
    """A reward function's answer as n floats (None -> NaN: unscorable); a RewardError naming the function and the
    row (rows[i] says which) for a wrong length or a value that is not a finite number."""
    if not isinstance(values, (list, tuple)) or len(values) != n:
        got = len(values) if isinstance(values, (list, tuple)) else type(values).__name__
        raise RewardError(f"reward {name} returned {got} rewards for {n} completions; return a list of one float "
                          "per completion")
    out = []
    for i, v in enumerate(values):
        if v is None:
            out.append(math.nan)
            continue
        if not isinstance(v, (int, float)) or not math.isfinite(v):
            raise RewardError(f"reward {name} returned {v!r} for {rows[i]}; return a finite float (None marks a "
                              "completion it cannot score)")
        out.append(float(v))
    return out
