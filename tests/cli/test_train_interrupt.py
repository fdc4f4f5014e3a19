"""Ctrl-C (a real SIGINT) during `lmkit train` after its first save: one line that names the last saved step and
the command that resumes from it, exit status 130; and that command does resume there."""
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest
from helpers.processes import process_env


@pytest.mark.slow
def test_sigint_names_the_last_save_and_the_resume_command(corpus_file, tmp_path):
    run = tmp_path / "run"
    flags = ["--preset", "tiny", "--corpus", corpus_file, "--out", str(run), "--batch-size", "2", "--seq-len", "16",
             "--precision", "fp32", "--log-every", "1", "--save-every", "2"]
    proc = subprocess.Popen([sys.executable, "-m", "lmkit", "train", *flags, "--max-steps", "100000"],
                            stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True, env=process_env())
    try:
        deadline = time.monotonic() + 240
        while not list(Path(run, "checkpoint").glob("step-*")):
            assert proc.poll() is None, proc.communicate()[1]
            assert time.monotonic() < deadline, "no checkpoint within 240 s"
            time.sleep(0.2)
        time.sleep(0.5)  # well into the steps after the first save
        proc.send_signal(signal.SIGINT)
        out, err = proc.communicate(timeout=120)
    finally:
        proc.kill()
    assert proc.returncode == 130, err
    saved = max(int(p.name.split("-")[1]) for p in Path(run, "checkpoint").glob("step-*"))
    line = err.strip().splitlines()[-1]
    assert line.startswith("lmkit: interrupted at step ")
    assert f"the last save is step {saved} in {run}: `lmkit train --out {run} --resume` continues from it" in line

    resumed = subprocess.run([sys.executable, "-m", "lmkit", "train", "--out", str(run), "--resume", "--max-steps",
                              str(saved + 1)], capture_output=True, text=True, env=process_env(), timeout=300)
    assert resumed.returncode == 0, resumed.stderr
    assert f"resuming at step {saved}" in resumed.stdout
