"""The worker process that runs a user's reward function (`--reward MODULE:FUNCTION`) outside lmkit's process.

    python reward_worker.py MODULE:FUNCTION   (or FILE.py:FUNCTION)

imports FUNCTION from MODULE (the working directory first on the path) or from the file, then answers one JSON line per request
line: {"prompts", "completions", "completion_ids", "columns"} -> {"rewards": [...]} from
FUNCTION(prompts=..., completions=..., completion_ids=..., **columns), TRL's signature; or {"error", "row"} when it
raises (row: the first row that raises alone, null when every row passes alone). Standard library only, so that
nothing of lmkit (or torch) is imported here; what the function prints goes to stderr, not into the answers.
"""
from __future__ import annotations

import importlib
import importlib.util
import json
import os
import sys
import traceback


def _call(function, request: dict, rows: slice | None = None):
    def part(values):
        return values if rows is None else values[rows]

    columns = {k: part(v) for k, v in request["columns"].items()}
    return function(prompts=part(request["prompts"]), completions=part(request["completions"]),
                    completion_ids=part(request["completion_ids"]), **columns)


def _failing_row(function, request: dict) -> int | None:
    for i in range(len(request["prompts"])):
        try:
            _call(function, request, slice(i, i + 1))
        except Exception:  # noqa: BLE001 (user code: any exception names its row)
            return i
    return None


def _error(exc: BaseException) -> str:
    frames = traceback.extract_tb(exc.__traceback__)
    where = f" ({frames[-1].filename}:{frames[-1].lineno})" if frames else ""
    return f"{type(exc).__name__}: {exc}{where}"


def main(spec: str) -> int:
    answers = os.fdopen(os.dup(1), "w", encoding="utf-8")
    os.dup2(2, 1)  # the function's prints go to stderr
    sys.stdout = sys.stderr
    sys.path.insert(0, os.getcwd())
    module_name, _, name = spec.rpartition(":")
    try:
        if module_name.endswith(".py"):  # a file: FILE.py:FUNCTION
            spec_ = importlib.util.spec_from_file_location(os.path.basename(module_name)[:-3], module_name)
            if spec_ is None:
                raise ImportError(f"cannot import {module_name}")
            module = importlib.util.module_from_spec(spec_)
            spec_.loader.exec_module(module)
        else:
            module = importlib.import_module(module_name)
        function = getattr(module, name)
        if not callable(function):
            raise TypeError(f"{spec} is a {type(function).__name__}, not a function")
    except Exception as exc:  # noqa: BLE001 (report why the user's function cannot be loaded)
        answers.write(json.dumps({"error": _error(exc)}) + "\n")
        answers.flush()
        return 1
    answers.write(json.dumps({"ready": True}) + "\n")
    answers.flush()
    for line in sys.stdin:
        request = json.loads(line)
        try:
            rewards = list(_call(function, request))
            answer = {"rewards": [None if r is None else float(r) for r in rewards]}
        except Exception as exc:  # noqa: BLE001 (user code)
            answer = {"error": _error(exc), "row": _failing_row(function, request)}
        answers.write(json.dumps(answer) + "\n")
        answers.flush()
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1]))
