"""Bad input through the CLI: one line on stderr and exit status 2, and snapshots that show no file changed."""
import hashlib
from pathlib import Path

from lmkit.cli import main


SPECIAL = ["<|endoftext|>", "<|pad|>"]


TEXT = "The quick brown fox jumps over the lazy dog. Pack my box with five dozen liquor jugs.\n\n"


def snapshot(folder: Path) -> dict[str, str]:
    return {str(p.relative_to(folder)): hashlib.sha256(p.read_bytes()).hexdigest()
            for p in sorted(folder.rglob("*")) if p.is_file()} if folder.exists() else {}


def fails(capsys, argv, *needles):
    """Run the CLI in-process: exit status 2, one line on stderr holding every needle."""
    capsys.readouterr()
    assert main(argv) == 2
    err = capsys.readouterr().err.strip()
    assert err.startswith("lmkit: error: ") and "\n" not in err and "Traceback" not in err, err
    for needle in needles:
        assert str(needle) in err, (needle, err)
    return err
