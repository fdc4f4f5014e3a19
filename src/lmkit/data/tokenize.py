"""The one seam between corpora and tokenizers: which tokenizer a training run uses.

`corpus_tokenizer` trains a byte-level BPE tokenizer on the training split (through
`lmkit.train_tokenizer`) and caches it under the user's cache folder, keyed by the corpus
fingerprint, the kind and the vocabulary size. Every run uses the special token
`<|endoftext|>` as BOS (and EOS: it separates documents, GPT-2 style) and `<|pad|>` for padding.
"""
from __future__ import annotations

import hashlib
import json
from pathlib import Path
from typing import Any

from lmkit.atomic import atomic_save_file
from lmkit.data.cache import cache_dir
from lmkit.data.corpus import Corpus
from lmkit.errors import TokenizerError
from lmkit.tokenizers import load_tokenizer, train_tokenizer

BOS = "<|endoftext|>"
PAD = "<|pad|>"
SPECIAL_TOKENS = [BOS, PAD]
TOKENIZER_CACHE_VERSION = 2  # 2: trainers count special-token text as text; Unigram follows tokenizers


def vocab_size_of(tok: Any) -> int:
    """Number of ids the tokenizer can produce (the model's vocabulary must be at least this)."""
    for name in ("vocab_size", "get_vocab_size"):
        value = getattr(tok, name, None)
        if value is not None:
            return int(value() if callable(value) else value)
    return len(tok)


def check_fits(tok: Any, model_vocab_size: int, tokenizer_path: Any, model_path: Any) -> None:
    """Every id the tokenizer can produce must index the model's embedding table (ids < vocab_size)."""
    n = vocab_size_of(tok)
    if n > model_vocab_size:
        raise TokenizerError(f"{tokenizer_path} has {n} ids but the model in {model_path} embeds only {model_vocab_size}; "
                             "use the tokenizer.json saved with that model (or a model trained with this tokenizer)")


def token_id(tok: Any, token: str) -> int:
    tid = tok.token_to_id(token)
    if tid is None:
        raise TokenizerError(f"the tokenizer has no {token!r} token; lmkit's training and evaluation need "
                             f"{' and '.join(SPECIAL_TOKENS)}: use a tokenizer.json that `lmkit train` or "
                             "`lmkit tokenizer train --kind bpe` wrote")
    return int(tid)


def special_ids(tok: Any, config: Any = None) -> tuple[int, int]:
    """(bos_id, pad_id) that rows of text start with and are padded with.

    lmkit's own `<|endoftext|>` and `<|pad|>` when the tokenizer has them; else, as for a pretrained
    LLaMA or BERT folder, the tokenizer's BOS token (else its CLS, else its EOS, else the model config's
    ids) and its pad token, or BOS as padding (padding is masked out of every loss, so any id serves).
    """
    bos = tok.token_to_id(BOS)
    if bos is None:
        roles = [getattr(tok, "bos_token_id", None), getattr(tok, "cls_token_id", None),
                 getattr(config, "bos_token_id", None), getattr(tok, "eos_token_id", None),
                 getattr(config, "eos_token_id", None)]
        roles = [r[0] if isinstance(r, (list, tuple)) and r else r for r in roles]  # config.json may list EOS ids
        bos = next((int(r) for r in roles if isinstance(r, int)), None)
    if bos is None:
        token_id(tok, BOS)  # raises the error that says which tokenizer to use
    pad = tok.token_to_id(PAD)
    if pad is None:
        pad = getattr(tok, "pad_token_id", None)
    return int(bos), int(bos if pad is None else pad)


def tokenizer_sha(tok: Any) -> str:
    """sha256 of the tokenizer's saved form: names it in token-cache keys."""
    text = tok.to_str() if hasattr(tok, "to_str") else json.dumps(tok.to_dict(), sort_keys=True)
    return hashlib.sha256(text.encode("utf-8")).hexdigest()


def corpus_tokenizer(corpus: Corpus, vocab_size: int, kind: str = "bpe", use_cache: bool = True):
    """A `kind` tokenizer of `vocab_size` ids trained on `corpus`, with SPECIAL_TOKENS (cached)."""
    key = json.dumps([TOKENIZER_CACHE_VERSION, kind, vocab_size, SPECIAL_TOKENS, corpus.fingerprint()])
    path = cache_dir("tokenizers") / f"{kind}-{vocab_size}-{hashlib.sha256(key.encode()).hexdigest()[:16]}.json"
    if use_cache and path.exists():
        try:
            cached = load_tokenizer(path)
            if all(cached.token_to_id(t) is not None for t in SPECIAL_TOKENS):
                return cached
        except TokenizerError:
            pass  # a damaged cache entry (or one without the special tokens) is retrained below
    tok = train_tokenizer(corpus.texts(), kind=kind, vocab_size=vocab_size, special_tokens=list(SPECIAL_TOKENS))
    if use_cache:
        atomic_save_file(path, lambda tmp: tok.save(tmp))
    return tok
