"""Token shards of a small real corpus, as `lmkit data prepare` writes them, for training-run tests."""
from __future__ import annotations

from pathlib import Path

import lmkit
from lmkit.data.prepare import prepare


def small_shards(root: Path, small_pydocs, vocab_size: int = 320) -> Path:
    """root/data: shards of 30 pydocs documents under a BPE tokenizer of `vocab_size` trained on them (root/tok.json);
    a tenth held out for validation. Returns root."""
    docs = small_pydocs(root / "c.jsonl", 30)
    tok = lmkit.train_tokenizer([d.text for d in docs], kind="bpe", vocab_size=vocab_size,
                                special_tokens=["<|endoftext|>", "<|pad|>"])
    tok.save(str(root / "tok.json"))
    prepare([str(root / "c.jsonl")], root / "tok.json", root / "data", workers=1, val_fraction=0.1)
    return root
