"""The documentation site builds with `mkdocs build --strict`: no broken link, anchor or API reference."""
import importlib.util
import os
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parent.parent


@pytest.mark.skipif(importlib.util.find_spec("mkdocs") is None or importlib.util.find_spec("mkdocstrings") is None,
                    reason="mkdocs and mkdocstrings are not installed (pip install -e '.[docs]')")
def test_site_builds_strict(tmp_path):
    env = {**os.environ, "NO_MKDOCS_2_WARNING": "1",
           "PYTHONPATH": os.pathsep.join([str(ROOT / "src"), os.environ.get("PYTHONPATH", "")])}
    run = subprocess.run([sys.executable, "-m", "mkdocs", "build", "--strict", "--site-dir", str(tmp_path / "site")],
                         cwd=ROOT, env=env, capture_output=True, text=True, timeout=300)
    assert run.returncode == 0, run.stdout + run.stderr
    built = {p.relative_to(tmp_path / "site").as_posix() for p in (tmp_path / "site").rglob("index.html")}
    for page in ("index.html", "architecture/index.html", "api/models/index.html", "benchmarks/index.html"):
        assert page in built, f"{page} missing from the site"
    # the API pages hold the rendered docstrings, not an empty shell
    models = (tmp_path / "site" / "api" / "models" / "index.html").read_text(encoding="utf-8")
    assert "load_model" in models and "Hugging Face" in models


def test_no_merge_conflict_markers_in_the_tree():
    """A conflict left in a page (or a module) is found here, not by a reader."""
    markers = ("<" * 7 + " ", "=" * 7 + "\n", ">" * 7 + " ")
    found = []
    for path in [*ROOT.joinpath("docs").rglob("*.md"), ROOT / "README.md", *ROOT.joinpath("src").rglob("*.py"),
                 *ROOT.joinpath("bench").rglob("*.py"), *ROOT.joinpath("tests").rglob("*.py")]:
        for number, line in enumerate(path.read_text(encoding="utf-8").splitlines(keepends=True), 1):
            if line.startswith(markers):
                found.append(f"{path.relative_to(ROOT)}:{number}")
    assert not found, found
