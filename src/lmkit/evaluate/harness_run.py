"""`lmkit harness`'s library side: lm-eval's `simple_evaluate` in process on an lmkit folder, with lmkit's offline
tasks (`harness_tasks/`) always on the task path. lm-eval is imported only here and only when called, so that
`import lmkit` works without the `eval` extra."""
from __future__ import annotations

import difflib
import json
import os
import subprocess
from pathlib import Path
from typing import Any

from lmkit.errors import LmkitError
from lmkit.extras import require

TASKS_DIR = Path(__file__).with_name("harness_tasks")


class HarnessError(LmkitError):
    """A harness run that cannot start: lm-eval missing, an unknown task, a task file that does not parse."""


def require_lm_eval():
    return require("lm_eval", "lmkit harness")


def check_task_files(folder: Path) -> None:
    """Parse every YAML under `folder` as lm-eval reads it (lm-eval itself skips a file that fails, silently)."""
    from lm_eval.tasks._yaml_loader import load_yaml

    if not folder.is_dir():
        raise HarnessError(f"--include-path {folder} is not a folder; give the folder that holds your task YAML files")
    for path in sorted(folder.rglob("*.yaml")):
        try:
            load_yaml(path, resolve_func=False)
        except Exception as exc:  # yaml's errors carry the line; anything else says what was wrong
            detail = " ".join(str(exc).split())
            raise HarnessError(f"task file {path} does not parse ({detail}); fix the YAML or move it out of "
                               "the include path") from None


def task_manager(tasks: list[str], include_path: str | None = None):
    """A TaskManager that knows lmkit's tasks and `include_path`'s; lm-eval's own catalogue is indexed only when a
    task is not found among those (indexing it takes seconds)."""
    from lm_eval.tasks import TaskManager

    paths = [TASKS_DIR]
    if include_path:
        check_task_files(Path(include_path))
        paths.append(Path(include_path))
    manager = TaskManager(include_path=[str(p) for p in paths], include_defaults=False)
    if any(t not in manager.all_tasks for t in tasks):
        manager = TaskManager(include_path=[str(p) for p in paths])
    unknown = [t for t in tasks if t not in manager.all_tasks]
    if unknown:
        hints = difflib.get_close_matches(unknown[0], manager.all_tasks, n=3)
        hint = f" (did you mean {', '.join(hints)}?)" if hints else ""
        raise HarnessError(f"unknown task {unknown[0]!r}{hint}; lmkit's tasks are {', '.join(lmkit_tasks())}, "
                           "and --include-path DIR adds your own YAML tasks")
    return manager


def lmkit_tasks() -> list[str]:
    """Names of the tasks shipped with lmkit."""
    names = []
    for path in sorted(TASKS_DIR.glob("*.yaml")):
        for line in path.read_text(encoding="utf-8").splitlines():
            if line.startswith("task: "):
                names.append(line.split(":", 1)[1].strip())
    return names


def run(model: str, tasks: list[str], num_fewshot: int | None = None, apply_chat_template: bool = False,
        fewshot_as_multiturn: bool | None = None, include_path: str | None = None, limit: int | float | None = None,
        batch_size: int = 1, device: str = "cpu", gen_kwargs: str | dict | None = None, log_samples: bool = False,
        seed: int = 0, lm=None, bootstrap_iters: int = 0) -> dict[str, Any]:
    """lm-eval's results dict for `tasks` on the folder `model` (or an lm-eval LM object `lm`); bootstrap_iters
    resamples estimate each metric's standard error (0: none, the Stderr column reads N/A)."""
    from unittest import mock

    lm_eval = require_lm_eval()
    import lm_eval.evaluator
    from lmkit.evaluate.harness import LmkitLM

    if not tasks:
        raise HarnessError(f"give at least one task with --tasks; lmkit's are {', '.join(lmkit_tasks())}")
    manager = task_manager(tasks, include_path)
    if lm is None:
        lm = LmkitLM(pretrained=model, batch_size=batch_size, device=device)
    if apply_chat_template:
        lm.chat_template(True)  # a folder without a template stops here, in one line
    if fewshot_as_multiturn is None:
        fewshot_as_multiturn = bool(apply_chat_template)
    with mock.patch.object(lm_eval.evaluator, "get_git_commit_hash", quiet_git_commit_hash):
        return lm_eval.simple_evaluate(
            model=lm, tasks=tasks, num_fewshot=num_fewshot, limit=limit, task_manager=manager,
            apply_chat_template=apply_chat_template, fewshot_as_multiturn=fewshot_as_multiturn, gen_kwargs=gen_kwargs,
            log_samples=log_samples, random_seed=seed, numpy_random_seed=seed, torch_random_seed=seed,
            bootstrap_iters=bootstrap_iters)


def quiet_git_commit_hash() -> str | None:
    """lm-eval's get_git_commit_hash (the results' git_hash) without the `fatal: not a git repository` that git
    writes to the terminal when the harness runs outside a checkout."""
    from lm_eval.loggers.utils import get_commit_from_path

    try:
        return subprocess.check_output(["git", "describe", "--always"], stderr=subprocess.DEVNULL).strip().decode()
    except (subprocess.CalledProcessError, FileNotFoundError):
        return get_commit_from_path(os.getcwd())


def results_table(results: dict[str, Any]) -> str:
    """lm-eval's markdown table of the results (and of the groups, where there are any)."""
    from lm_eval.utils import make_table

    table = make_table(results)
    if results.get("groups"):
        table += "\n" + make_table(results, "groups")
    return table


def results_json(results: dict[str, Any]) -> str:
    """The results as lm-eval's own CLI writes them (samples left out)."""
    from lm_eval.utils import handle_non_serializable

    kept = {k: v for k, v in results.items() if k != "samples"}
    return json.dumps(kept, indent=2, default=handle_non_serializable, ensure_ascii=False)
