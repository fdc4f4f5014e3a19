"""tools/check_layers.py: the repository follows the arrows of docs/architecture.md and has no import circle; on a
made-up project the check catches a wrong arrow, a circle closed inside a function, an eager lazy-only import and
a place the table does not name, and lets pass what the documentation allows."""
import importlib.util
import textwrap
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]


@pytest.fixture(scope="module")
def layers():
    spec = importlib.util.spec_from_file_location("check_layers", ROOT / "tools" / "check_layers.py")
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def test_the_repository_follows_its_arrows(layers):
    errors, _ = layers.check(ROOT)
    assert errors == []


ARCHITECTURE = """\
# Architecture

## Layers and their import arrows

| place | holds | imports |
| --- | --- | --- |
| `errors.py`, `progress.py` | the foundation | nothing of lmkit |
| `nn/` | layers | `errors` |
| `models/` | models | `errors`, `nn` (the layers) |
| `search.py`, `sentence/` | search | `errors`; `models` (lazy) |

### Circles and the allowed function-local imports

| function-local import | why it stays |
| --- | --- |
| `lmkit.models.a` imports `lmkit.models.b` | allowed here |
"""


def project(tmp_path: Path, files: dict[str, str]) -> Path:
    (tmp_path / "docs").mkdir()
    (tmp_path / "docs" / "architecture.md").write_text(ARCHITECTURE)
    base = {"__init__.py": "", "errors.py": "", "progress.py": "", "nn/__init__.py": "", "models/__init__.py": "",
            "models/a.py": "", "models/b.py": "", "sentence/__init__.py": ""}
    for name, text in {**base, **files}.items():
        path = tmp_path / "src" / "lmkit" / name
        path.parent.mkdir(parents=True, exist_ok=True)
        path.write_text(textwrap.dedent(text))
    return tmp_path


def test_a_clean_project_passes_with_allowed_foundation_and_typing_only_imports(layers, tmp_path):
    root = project(tmp_path, {
        "models/a.py": "from lmkit.nn import x\ndef f():\n    from lmkit.models import b\n",
        "models/b.py": "from lmkit.models import a\n",  # a -> b is allowed by the table of architecture.md
        "nn/layer.py": "from typing import TYPE_CHECKING\nif TYPE_CHECKING:\n    from lmkit.nn.other import T\n",
        "nn/other.py": "from lmkit.nn import layer\nfrom lmkit.progress import bar\n",  # the foundation: anywhere
        "sentence/__init__.py": "def f():\n    from lmkit.models import a\n",
    })
    errors, _ = layers.check(root, known=set())
    assert errors == []


def test_a_known_circle_is_reported_until_it_is_broken(layers, tmp_path):
    files = {"nn/x.py": "def f():\n    from lmkit.nn import y\n", "nn/y.py": "from lmkit.nn import x\n",
             "models/a.py": "def f():\n    from lmkit.models import b\n"}
    errors, notes = layers.check(project(tmp_path, files), known={("lmkit.nn.x", "lmkit.nn.y")})
    assert errors == [] and any("known circle" in n and "lmkit.nn.x -> lmkit.nn.y" in n for n in notes)
    (tmp_path / "src" / "lmkit" / "nn" / "y.py").write_text("")  # the circle is broken: the entry must go
    errors, _ = layers.check(tmp_path, known={("lmkit.nn.x", "lmkit.nn.y")})
    assert errors == ["KNOWN_CIRCLES lists lmkit.nn.x -> lmkit.nn.y, which closes no circle any more; remove the entry"]


def test_each_broken_rule_is_reported(layers, tmp_path):
    root = project(tmp_path, {
        "nn/__init__.py": "from lmkit.models import a\n",                    # an arrow pointing up
        "nn/x.py": "def f():\n    from lmkit.nn import y\n",              # closes a circle inside a function
        "nn/y.py": "from lmkit.nn import x\n",
        "sentence/__init__.py": "from lmkit.models import b\n",             # lazy-only, made on import
        "plots/__init__.py": "",                                            # not in the table
    })
    errors, _ = layers.check(root, known=set())
    text = "\n".join(errors)
    assert "src/lmkit/nn/__init__.py imports lmkit.models.a: nn must not depend on models" in text
    assert "import circle between lmkit.nn.x, lmkit.nn.y; closed inside a function by lmkit.nn.x -> lmkit.nn.y" in text
    assert "src/lmkit/sentence/__init__.py imports lmkit.models.b on import" in text
    assert "the place 'plots' is not in the layer table" in text
    # the allowed import is no longer made: its row must go
    assert "allows the function-local import lmkit.models.a -> lmkit.models.b, which the code no longer makes" in text
    assert len(errors) == 5
