"""The `lmkit` command itself: --version, help, and progress output when stderr is not a terminal."""
import subprocess
import sys

import lmkit
from lmkit.cli import main


def test_version_and_help(capsys):
    r = subprocess.run([sys.executable, "-m", "lmkit", "--version"], capture_output=True, text=True, timeout=120)
    assert r.returncode == 0 and r.stdout.strip() == f"lmkit {lmkit.__version__}", r
    r = subprocess.run([sys.executable, "-m", "lmkit", "--help"], capture_output=True, text=True, timeout=120)
    assert r.returncode == 0 and "train" in r.stdout and "--version" in r.stdout


def test_tokenizer_training_draws_no_bar_into_a_file(tmp_path, capsys):
    """Under pytest stderr is not a terminal, like a pipe or a log file: nothing of tqdm reaches it."""
    corpus = tmp_path / "corpus.txt"
    corpus.write_text("def f(x):\n    return x + 1\n\n" * 50, encoding="utf-8")
    for kind, size in (("bpe", 300), ("unigram", 60)):
        assert main(["tokenizer", "train", "--kind", kind, "--vocab-size", str(size), "--corpus", str(corpus),
                     "--out", str(tmp_path / f"{kind}.json")]) == 0
        assert capsys.readouterr().err == ""
    assert main(["tokenizer", "train", "--kind", "bpe", "--vocab-size", "10", "--corpus", str(corpus),
                 "--out", str(tmp_path / "small.json")]) == 2
    assert capsys.readouterr().err.startswith("lmkit: error: vocab_size 10 is below")


def test_subpackages_are_attributes_of_a_bare_import():
    """`import lmkit` then lmkit.tokenizers.load_tokenizer, lmkit.peft..., as with torch.nn: in a fresh
    interpreter, where nothing has imported the subpackages yet."""
    code = ("import lmkit, sys; assert 'lmkit.tokenizers' not in sys.modules; "
            "print(lmkit.tokenizers.load_tokenizer.__name__, lmkit.peft.__name__, lmkit.nn.__name__, "
            "'tokenizers' in dir(lmkit))")
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=120)
    assert out.returncode == 0, out.stderr
    assert out.stdout.split() == ["load_tokenizer", "lmkit.peft", "lmkit.nn", "True"]
    proc = subprocess.run([sys.executable, "-c", "import lmkit; lmkit.nope"], capture_output=True, text=True, timeout=120)
    assert "has no attribute 'nope'" in proc.stderr
