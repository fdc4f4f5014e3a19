"""Escapes, each tried by a real sample in the real sandbox, and the host shown unharmed afterwards; the
evaluator keeps going and writes every result."""
from __future__ import annotations

import json
import os
import signal
import socket
import threading
import time
from pathlib import Path

import pytest

from lmkit.code import evaluate
from lmkit.code.evaluate import evaluate_file, evaluate_samples
from lmkit.code.sandbox import SandboxError, SandboxPool, isolation_available, run_program

pytestmark = [pytest.mark.skipif(isolation_available() is not None,
                                reason=f"the kernel refuses the sandbox's namespaces: {isolation_available()}"),
              pytest.mark.xdist_group("sandbox")]  # one worker runs the sandboxed tests: the cgroup check sees only its own

PROBLEM = {"task_id": "escape/f", "prompt": "def f():\n", "entry_point": "f",
           "test": "def check(candidate):\n    assert candidate() == 1\n"}


def body(*lines: str) -> str:
    return "".join(f"    {line}\n" for line in lines)


@pytest.fixture
def listener():
    """A loopback TCP listener that records every connection it accepts."""
    server = socket.socket()
    server.bind(("127.0.0.1", 0))
    server.listen(8)
    server.settimeout(0.2)
    seen, stop = [], threading.Event()

    def accept():
        while not stop.is_set():
            try:
                seen.append(server.accept()[0])
            except OSError:
                pass
    thread = threading.Thread(target=accept, daemon=True)
    thread.start()
    yield server.getsockname()[1], seen
    stop.set()
    thread.join()
    server.close()


def test_escapes_leave_the_host_unharmed(tmp_path, listener):
    port, connections = listener
    home = tmp_path / "home"  # the caller's home, as far as the samples know
    home.mkdir()
    keep, new = home / "keep.txt", home / "new.txt"
    keep.write_text("mine")
    cases = {  # name: (completion, passed)
        "control": (body("return 1"), True),
        "write outside": (body(f"open({str(new)!r}, 'w').write('pwned')", "return 1"), False),
        "delete outside": (body("import posix", f"posix.unlink({str(keep)!r})", "return 1"), False),
        "socket": (body("import socket", f"socket.create_connection(('127.0.0.1', {port}), timeout=2).sendall(b'x')",
                        "return 1"), False),
        "fork bomb": (body("import posix", "while True:", "    try:", "        posix.fork()",
                           "    except OSError:", "        pass"), False),
        "20 GB": (body("x = bytearray(20 * 2**30)", "x[-1] = 1", "return 1"), False),
        "kill parent": (body("import posix, signal", f"for pid in (posix.getppid(), {os.getpid()}, 1, 0):",
                             "    try:", "        posix.kill(pid, signal.SIGKILL)", "    except OSError:",
                             "        pass", "return 1"), True),  # every kill misses: it goes on to pass
        "sys.exit before checks": (body("return 1") + "import sys\nsys.exit(0)\n", False),
        "os._exit before checks": (body("return 1") + "import posix\nposix._exit(0)\n", False),
        "profile hook ends check": (body("return 0") + "import sys\ndef hook(frame, event, arg):\n"
                                    "    if event == 'call' and frame.f_code.co_name == 'check':\n"
                                    "        raise SystemExit(0)\nsys.setprofile(hook)\n", False),
        "patched runner": (body("return 0") + "import __main__, posix\n__main__.flush = lambda c: posix._exit(0)\n"
                           "__main__.main = __main__.sample = None\n", False),
        "atexit passed": (body("return 0") + "import atexit, posix\natexit.register(lambda: posix.write(1, "
                          "b'passed'))\n", False),
        "patched AssertionError": (body("return 0") + "import builtins\nbuiltins.AssertionError = "
                                   "type('Quiet', (Exception,), {})\n", False),
        "10,000 lines": (body("for i in range(10000):", "    print(i)", "return 1"), True),
        "fd spam": (body("import posix", "while True:", "    posix.write(1, b'x' * 65536)"), False),
    }
    problems = tmp_path / "problems.jsonl"
    problems.write_text(json.dumps(PROBLEM) + "\n")
    samples = tmp_path / "samples.jsonl"
    samples.write_text("".join(json.dumps({"task_id": "escape/f", "completion": c, "case": name}) + "\n"
                               for name, (c, _) in cases.items()))
    cgroups = Path("/sys/fs/cgroup/pids")
    before = set(cgroups.glob("lmkit-*")) if cgroups.is_dir() else set()  # a killed run elsewhere may have left some
    scores, out = evaluate_file(samples, str(problems), (1, 2), timeout=2.0, workers=4)

    rows = [json.loads(line) for line in out.read_text().splitlines()]
    assert [r["case"] for r in rows] == list(cases)  # every result, in input order
    for row in rows:
        assert row["passed"] is cases[row["case"]][1], row
        assert row["result"] == "passed" if row["passed"] else (row["result"] == "timed out"
                                                                or row["result"].startswith("failed: ")), row
    assert scores["pass@1"] == pytest.approx(3 / len(cases))
    assert keep.read_text() == "mine" and not new.exists()
    assert connections == []
    by_case = {r["case"]: r["result"] for r in rows}
    assert by_case["20 GB"] == "failed: "  # MemoryError, under RLIMIT_AS
    assert by_case["socket"].startswith("failed: [Errno 101]")  # no network in the namespace
    if cgroups.is_dir():  # each sample's cgroup was removed, so nothing it started is still running
        assert not set(cgroups.glob("lmkit-*")) - before


def test_output_is_captured_with_a_cap():
    result = run_program("import posix\nfor i in range(10000):\n    print(i)\nposix.write(1, b'x' * 100000)\n", 5.0)
    assert result.passed
    assert result.output.startswith("x" * 1000) and 4096 <= len(result.output) <= 2 * 4096


def test_without_isolation_samples_still_run_in_their_own_process(tmp_path):
    assert run_program("import os\nos.getcwd()\n", 5.0, isolate=False).passed is False  # guarded
    assert run_program("assert 1 + 1 == 2\n", 5.0, isolate=False).passed
    assert not run_program("import sys\nsys.exit(0)\n", 5.0, isolate=False).passed
    assert run_program("while True:\n    pass\n", 0.5, isolate=False).result == "timed out"


def test_refuses_to_run_where_the_kernel_refuses_isolation(monkeypatch):
    monkeypatch.setattr(evaluate, "isolation_available", lambda: "unshare: Operation not permitted")
    rows = [{"task_id": "escape/f", "completion": body("return 1")}]
    with pytest.raises(SandboxError, match="--unsafe-no-isolation"):
        evaluate_samples(rows, {"escape/f": PROBLEM}, timeout=1.0)
    assert evaluate_samples(rows, {"escape/f": PROBLEM}, timeout=5.0, isolate=False)[0].passed


def test_one_launcher_serves_many_samples_each_in_fresh_isolation():
    """The fork server is reused, its samples are not: what one sample changes (a file in its /tmp, a preloaded
    module, the random state) is gone for the next."""
    # its work folder is always writable; /tmp too unless the interpreter itself lives under /tmp (then read-only)
    meddle = ("import math, random, typing\nopen('left.txt', 'w').write('x')\ntry:\n    open('/tmp/left.txt', 'w')\n"
              "except OSError:\n    pass\nmath.pi = 3\ntyping.List = None\nprint(random.random())\n")
    look = ("import math, os, random, typing\nassert not os.path.exists('left.txt')\n"
            "assert not os.path.exists('/tmp/left.txt')\nassert math.pi > 3.14\n"
            "assert typing.List is not None\nprint(random.random())\n")
    with SandboxPool(1) as pool:
        first = pool.run(meddle, 5.0)
        second = pool.run(look, 5.0)
        third = pool.run(look, 5.0)
        assert len(pool._all) == 1  # one launcher ran all three
    assert first.passed and second.passed and third.passed, (first, second, third)
    draws = {first.output, second.output, third.output}
    assert len(draws) == 3  # every sample draws from a fresh random state, not the server's
    assert not Path("/tmp/left.txt").exists()


def test_a_killed_launcher_costs_one_sample_and_is_replaced():
    cgroups = Path("/sys/fs/cgroup/pids")
    before = set(cgroups.glob("lmkit-*")) if cgroups.is_dir() else set()
    with SandboxPool(1) as pool:
        assert pool.run("pass", 5.0).passed
        launcher = pool._all[0]
        killer = threading.Timer(0.5, os.killpg, (launcher.proc.pid, signal.SIGKILL))
        killer.start()
        start = time.monotonic()
        result = pool.run("import time\ntime.sleep(30)\n", 60.0)
        killer.join()
        assert time.monotonic() - start < 20  # its job process died with it: nothing waited for the sleep
        assert not result.passed and result.result.startswith("failed: the sandbox process ended"), result
        assert pool.run("assert 1 + 1 == 2\n", 5.0).passed  # a fresh launcher took its place
        assert launcher not in pool._all
    if cgroups.is_dir():
        assert not set(cgroups.glob("lmkit-*")) - before
