"""What `lmkit harness` writes to stderr outside a git checkout: no `fatal: not a git repository` (lm-eval asks git for
the results' git_hash), and one line saying why the Stderr column is N/A; --bootstrap-iters fills that column."""
from __future__ import annotations

import json
import shutil
import subprocess
import sys

import pytest

pytest.importorskip("lm_eval")
pytest.importorskip("transformers")

from test_harness import _save, gpt2_folder  # noqa: E402
from helpers.processes import process_env  # noqa: E402


@pytest.fixture(scope="module")
def folder(tmp_path_factory):
    model, tok = gpt2_folder(None, n_positions=1024)
    return _save(model, tok, tmp_path_factory.mktemp("gpt2"))


def harness(folder, cwd, *flags):
    return subprocess.run([sys.executable, "-m", "lmkit", "harness", "--model", folder, "--tasks", "pydoc_mc",
                           "--limit", "4", *flags], capture_output=True, text=True, cwd=cwd, env=process_env(),
                          timeout=600)


@pytest.mark.skipif(shutil.which("git") is None, reason="git is what prints the message")
def test_no_git_noise_and_one_word_on_the_stderr_column(folder, tmp_path):
    outside = subprocess.run(["git", "rev-parse", "--git-dir"], cwd=tmp_path, capture_output=True)
    assert outside.returncode != 0, "the test needs a folder outside any git checkout"
    r = harness(folder, tmp_path, "--output", "results.json")
    assert r.returncode == 0, r.stderr
    assert "not a git repository" not in r.stderr
    assert r.stderr.count("Stderr is N/A") == 1 and "--bootstrap-iters" in r.stderr
    assert "|pydoc_mc" in r.stdout and "N/A" in r.stdout


def test_bootstrap_iters_fill_the_stderr_column(folder, tmp_path):
    r = harness(folder, tmp_path, "--bootstrap-iters", "20", "--output", "results.json")
    assert r.returncode == 0, r.stderr
    assert "Stderr is N/A" not in r.stderr
    results = json.loads((tmp_path / "results.json").read_text())["results"]["pydoc_mc"]
    assert isinstance(results["acc_stderr,none"], float)
