"""A command whose optional extra is not installed says which extra to install in one line (exit 2), for every extra
a command needs: the module is made unimportable in a fresh interpreter (sys.modules[name] = None)."""
import json
import subprocess
import sys

import pytest

from lmkit.extras import EXTRAS, MissingExtraError, message, require

SCRIPT = """
import contextlib, io, json, sys
cases = json.loads(sys.argv[1])
from lmkit.cli import main
out = []
for module, argv in cases:
    gone = [k for k in sys.modules if k == module or k.startswith(module + ".") or k.startswith("lmkit.serve")]
    saved = {k: sys.modules.pop(k) for k in gone}
    sys.modules[module] = None
    err = io.StringIO()
    with contextlib.redirect_stderr(err):
        rc = main(argv)
    del sys.modules[module]
    sys.modules.update(saved)
    out.append([rc, err.getvalue()])
print(json.dumps(out))
"""


def test_each_command_names_its_extra(tmp_path):
    folder = str(tmp_path / "missing")
    cases = [("uvicorn", ["serve", "--model", folder]), ("fastapi", ["serve", "--model", folder]),
             ("lm_eval", ["harness", "--model", folder, "--tasks", "x"]),
             ("faiss", ["rag", "query", "--index", folder, "--query", "x"]),
             ("bm25s", ["rag", "index", "--encoder", folder, "--corpus", "pydocs", "--out", folder])]
    done = subprocess.run([sys.executable, "-c", SCRIPT, json.dumps(cases)], capture_output=True, text=True,
                          timeout=300, check=True)
    for (module, argv), (rc, err) in zip(cases, json.loads(done.stdout.strip().splitlines()[-1])):
        extra = EXTRAS[module]
        assert rc == 2 and err.strip().splitlines() == [
            f"lmkit: error: lmkit {argv[0]} needs {module}, which is not installed; install lmkit's {extra} extra: "
            f"pip install 'lmkit[{extra}]'"], (module, err)


def test_require_imports_or_names_the_extra(monkeypatch):
    assert require("json") is json
    monkeypatch.setitem(sys.modules, "xgrammar", None)
    with pytest.raises(MissingExtraError, match=r"pip install 'lmkit\[serve\]'"):
        require("xgrammar", "structured outputs")
    assert message("somepkg") == "somepkg is needed, which is not installed; pip install somepkg"


def test_every_extra_named_is_one_of_pyproject():
    import tomllib
    from pathlib import Path

    pyproject = Path(__file__).parents[1] / "pyproject.toml"
    extras = tomllib.loads(pyproject.read_text())["project"]["optional-dependencies"]
    assert set(EXTRAS.values()) <= set(extras)
