"""The environment of the processes a test starts (the CLI, torchrun's ranks)."""
import os
import signal
import subprocess
import time


def process_env() -> dict:
    """os.environ with one intra-op thread per process (two cores are shared) and unbuffered output."""
    return {**os.environ, "OMP_NUM_THREADS": "1", "PYTHONUNBUFFERED": "1"}


def saved_steps(out):
    return sorted(int(p.name[5:]) for p in (out / "checkpoint").glob("step-*")) if (out / "checkpoint").exists() else []


def kill_after_a_save(cmd, out, after_step, rng):
    """Start a training process, SIGKILL it at a random moment after checkpoint `after_step` exists."""
    env = {**os.environ, "OMP_NUM_THREADS": "1"}
    proc = subprocess.Popen(cmd, stdout=subprocess.DEVNULL, stderr=subprocess.PIPE, env=env)
    deadline = time.time() + 240
    while not any(s >= after_step for s in saved_steps(out)):
        assert proc.poll() is None, proc.stderr.read().decode()[-2000:]
        assert time.time() < deadline, "no checkpoint appeared"
        time.sleep(0.005)
    time.sleep(rng.uniform(0, 0.15))  # anywhere: mid-step, mid-evaluation, mid-save
    assert proc.poll() is None, "the run finished before it could be killed; give it more steps"
    proc.send_signal(signal.SIGKILL)
    proc.wait()
    proc.stderr.close()
    assert proc.returncode == -signal.SIGKILL
