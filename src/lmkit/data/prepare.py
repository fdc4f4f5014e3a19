"""`prepare`: tokenize a corpus in parallel into token shards (see `lmkit.data.shards`).

Documents are read as a stream (text files in blocks, JSONL line by line), so memory stays flat
however large the corpus is: the main process batches about `shard_bytes` of text, a pool of
worker processes (each holding the tokenizer) encodes a batch and writes it as one shard, and
about one batch per worker is in flight. A document goes to the validation split when
`split_hash(id) < val_fraction` (the rule of `Corpus.split`), so splits do not depend on order.
Everything is written into a temporary folder beside `out` and moved in only when the whole set
is done (index last): a failure or Ctrl-C leaves `out` as it was, a previous shard set included.
"""
from __future__ import annotations

import codecs
import hashlib
import inspect
import multiprocessing as mp
import os
import re
from collections import deque
from pathlib import Path
from typing import Any, Iterable, Iterator

import numpy as np
from safetensors.numpy import save as save_safetensors

from lmkit.atomic import atomic_write_bytes, atomic_write_json, staged_folder
from lmkit.data.builtin import BUILTIN, builtin_corpus
from lmkit.data.corpus import (CHUNK_CHARS, _expand, cut_point, group_paragraphs, jsonl_document, paragraphs,
                               refuse_output_folder)
from lmkit.data.documents import Document, split_hash
from lmkit.data.shards import DTYPES, FORMAT, INDEX, ShardDataset, TOKENIZER, VERSION, file_sha256, token_dtype
from lmkit.data.tokenize import BOS, vocab_size_of
from lmkit.errors import CorpusError, TokenizerError
from lmkit.tokenizers import load_tokenizer

SHARD_BYTES = 16 << 20  # text per shard: about 5M tokens, 10 MB of uint16 ids
ENCODE_CHARS = 1 << 20  # text encoded at a time inside a worker
BLOCK = 1 << 20


# streaming readers --------------------------------------------------------------------------------

def _decoded_blocks(path: Path) -> Iterator[str]:
    """The file's text in blocks, decoded incrementally; a non-UTF-8 byte names its offset."""
    decoder = codecs.getincrementaldecoder("utf-8")()
    offset = 0
    try:
        f = open(path, "rb")
    except OSError as exc:
        raise CorpusError(f"cannot read corpus file {str(path)!r}: {exc.strerror}") from None
    with f:
        while True:
            data = f.read(BLOCK)
            try:
                text = decoder.decode(data, final=not data)
            except UnicodeDecodeError as exc:
                raise CorpusError(f"corpus file {str(path)!r} is not UTF-8 (byte {offset + exc.start}); "
                                  "convert it, e.g. `iconv -f latin1 -t utf-8`") from None
            offset += len(data)
            if text:
                yield text
            if not data:
                return


def stream_paragraphs(path: Path, max_chars: int = CHUNK_CHARS) -> Iterator[str]:
    """`corpus.paragraphs` of the whole file, holding at most one block and max_chars of text in memory."""
    buf = ""
    for block in _decoded_blocks(path):
        buf += block
        pos, end = 0, buf.find("\n\n")
        while True:
            if end >= 0 and end - pos <= max_chars:
                yield buf[pos:end]
                pos = end + 2
                end = buf.find("\n\n", pos)
            elif end >= 0 or len(buf) - pos >= max_chars + 2:  # over-long: its first max_chars + 1 are here
                stop, pos_next = cut_point(buf, pos, max_chars)
                yield buf[pos:stop]
                pos = pos_next
            else:
                break
        buf = buf[pos:]
    yield from paragraphs(buf, max_chars)


def stream_text_file(path: Path, label: str, max_chars: int = CHUNK_CHARS) -> Iterator[Document]:
    """The documents `corpus.read_text_file` gives (`corpus.chunk_text`), streamed."""
    for i, piece in enumerate(group_paragraphs(stream_paragraphs(path, max_chars), max_chars)):
        yield Document(f"{label}#{i}", piece)


def stream_jsonl(path: Path, label: str) -> Iterator[Document]:
    """The documents `corpus.read_jsonl` gives: one {"text": ..., "id": ...} object per line."""
    lineno = 0
    partial: list[str] = []  # a line longer than a block, kept in parts (joining every block would be quadratic)

    def documents(lines: Iterable[str]) -> Iterator[Document]:
        nonlocal lineno
        for line in lines:
            lineno += 1
            doc = jsonl_document(path, label, lineno, line)
            if doc is not None:
                yield doc

    for block in _decoded_blocks(path):
        cut = block.rfind("\n")
        if cut < 0:
            partial.append(block)
            continue
        text = "".join(partial) + block[:cut + 1]
        partial = [block[cut + 1:]]
        yield from documents(text.splitlines())
    yield from documents("".join(partial).splitlines())


def stream_documents(specs: Iterable[str]) -> Iterator[Document]:
    """Documents of built-in corpora, files, folders and globs (as `load_corpus` reads them), streamed."""
    specs = [os.fspath(s) for s in specs]
    if not specs:
        raise CorpusError("no corpus given; name a built-in corpus (pydocs, pycode) or pass text files")
    for spec in specs:
        if spec in BUILTIN and not os.path.exists(spec):
            yield from builtin_corpus(spec).documents
            continue
        for path in _expand(spec):
            yield from (stream_jsonl(path, str(path)) if path.suffix == ".jsonl" else stream_text_file(path, str(path)))


# tokenizing workers -----------------------------------------------------------------------------

_WORKER: dict[str, Any] = {}


def load_any_tokenizer(path: str | Path):
    return load_tokenizer(path)


def encode_texts(tok: Any, texts: list[str]) -> list[list[int]]:
    """Ids of each text without special tokens (lmkit or `tokenizers` objects), one process."""
    kwargs = {"add_special_tokens": False}
    if "num_workers" in inspect.signature(tok.encode_batch).parameters:
        kwargs["num_workers"] = 1  # this process is already one of a pool
    out = tok.encode_batch(texts, **kwargs)
    return [list(getattr(ids, "ids", ids)) for ids in out]


def _init_worker(tokenizer_path: str) -> None:
    _WORKER["tok"] = load_any_tokenizer(tokenizer_path)


def encode_shard(texts: list[str], bos_id: int, dtype: str, vocab_size: int) -> dict[str, np.ndarray]:
    """{"tokens": sep d_1 sep d_2 ..., "doc_offsets", "doc_bytes"} of a batch (empty encodings dropped).

    Encoded ENCODE_CHARS of text at a time, each piece turned into compact arrays at once: Python
    lists of ids cost ~36 bytes a token, so a whole shard as lists would need ~12x its text in memory.
    """
    pieces, lengths, nbytes, start = [], [], [], 0
    while start < len(texts):
        stop, size = start, 0
        while stop < len(texts) and (stop == start or size < ENCODE_CHARS):
            size += len(texts[stop])
            stop += 1
        for text, ids in zip(texts[start:stop], encode_texts(_WORKER["tok"], texts[start:stop])):
            if not ids:
                continue
            row = np.asarray(ids, dtype=np.int64)
            if row.max() >= vocab_size or row.min() < 0:
                raise TokenizerError(f"the tokenizer produced id {int(row.max())} outside its vocabulary of {vocab_size}")
            pieces.append(np.concatenate([[bos_id], row]).astype(DTYPES[dtype][1]))
            lengths.append(len(row) + 1)
            nbytes.append(len(text.encode("utf-8")))
        start = stop
    offsets = np.concatenate([[0], np.cumsum(np.array(lengths, dtype=np.int64))]).astype(np.int64)
    tokens = np.concatenate(pieces) if pieces else np.zeros(0, dtype=DTYPES[dtype][1])
    return {"tokens": tokens, "doc_offsets": offsets, "doc_bytes": np.array(nbytes, dtype=np.int64)}


def _write_shard(out: str, split: str, number: int, texts: list[str], bos_id: int, dtype: str,
                 vocab_size: int) -> dict[str, Any]:
    arrays = encode_shard(texts, bos_id, dtype, vocab_size)
    data = save_safetensors(arrays, metadata={"format": FORMAT})
    name = f"{split}-{number:05d}.safetensors"
    atomic_write_bytes(Path(out) / name, data)
    return {"file": name, "num_tokens": len(arrays["tokens"]), "num_documents": len(arrays["doc_bytes"]),
            "num_bytes": int(arrays["doc_bytes"].sum()), "size": len(data), "sha256": hashlib.sha256(data).hexdigest()}


def prepare(corpus: Iterable[str], tokenizer: str | Path, out: str | Path, workers: int | None = None,
            val_fraction: float = 0.05, shard_bytes: int = SHARD_BYTES, separator: str = BOS,
            overwrite: bool = False) -> dict[str, Any]:
    """Tokenize the corpus specs into shards under `out`; returns the index (also written to out/index.json)."""
    out, corpus = Path(out), list(corpus)
    if not 0.0 <= val_fraction < 1.0:
        raise CorpusError(f"--val-fraction must lie in [0, 1), got {val_fraction}")
    if workers is not None and workers < 1:
        raise CorpusError(f"--workers must be at least 1, got {workers}")
    if not 0 < shard_bytes < float("inf"):
        raise CorpusError(f"--shard-mb must be a positive number of megabytes, got {shard_bytes / (1 << 20)}")
    shard_bytes = max(1, int(shard_bytes))
    if out.exists() and not out.is_dir():
        raise CorpusError(f"--out {out} is a file; give a folder for the shards")
    refuse_output_folder(corpus, "--out", out, (INDEX, TOKENIZER, "train-00000.safetensors",
                                                "validation-00000.safetensors"))
    if (out / INDEX).exists() and not overwrite:
        raise CorpusError(f"{out} already holds prepared shards ({INDEX}); pass --overwrite or choose another --out")
    tok_path = Path(tokenizer)
    tok = load_any_tokenizer(tok_path)
    vocab_size = vocab_size_of(tok)
    bos_id = tok.token_to_id(separator)
    if bos_id is None:
        raise TokenizerError(f"the tokenizer {tok_path} has no {separator!r} token to separate documents; "
                             "pass --separator with one of its special tokens")
    dtype = token_dtype(vocab_size)
    tok_file = tok_path / TOKENIZER if tok_path.is_dir() else tok_path
    tok_bytes = tok_file.read_bytes()
    stale = re.compile(r"(train|validation)-\d{5}\.safetensors")
    with staged_folder(out, last=(INDEX,), remove=lambda f: bool(stale.fullmatch(f.name))) as stage:
        index = _write_shards(corpus, stage, tok, tok_path, bos_id, dtype, vocab_size, workers, val_fraction, shard_bytes)
        index = {**{k: v for k, v in index.items() if k != "splits"}, "separator": separator,
                 "val_fraction": val_fraction, "sources": [os.fspath(c) for c in corpus],
                 "tokenizer": {"file": TOKENIZER, "sha256": hashlib.sha256(tok_bytes).hexdigest()},
                 "splits": index["splits"]}
        atomic_write_bytes(stage / TOKENIZER, tok_bytes)
        atomic_write_json(stage / INDEX, index)
    return index


def _write_shards(corpus: Iterable[str], out: Path, tok: Any, tok_path: Path, bos_id: int, dtype: str,
                  vocab_size: int, workers: int | None, val_fraction: float, shard_bytes: int) -> dict[str, Any]:
    """Encode the corpus into shards in `out` (a pool of `workers` processes); the index without its sources."""
    workers = workers if workers is not None else (os.cpu_count() or 1)
    splits = {"train": [], "validation": []}
    counters = {"train": 0, "validation": 0}
    args = (bos_id, dtype, vocab_size)
    pool = mp.get_context("spawn").Pool(workers, _init_worker, (str(tok_path),)) if workers > 1 else None
    if pool is None:
        _WORKER["tok"] = tok
    pending: deque = deque()

    def submit(split: str, texts: list[str]) -> None:
        number = counters[split]
        counters[split] += 1
        if pool is None:
            splits[split].append(_write_shard(str(out), split, number, texts, *args))
            return
        pending.append((split, pool.apply_async(_write_shard, (str(out), split, number, texts, *args))))
        while len(pending) > workers:  # bounded: about workers + 1 batches of text in flight
            done_split, result = pending.popleft()
            splits[done_split].append(result.get())

    try:
        buffers: dict[str, list[str]] = {"train": [], "validation": []}
        sizes = {"train": 0, "validation": 0}
        seen = 0
        for doc in stream_documents(corpus):
            seen += 1
            split = "validation" if val_fraction > 0 and split_hash(doc.id) < val_fraction else "train"
            buffers[split].append(doc.text)
            sizes[split] += len(doc.text)
            if sizes[split] >= shard_bytes:
                submit(split, buffers[split])
                buffers[split], sizes[split] = [], 0
        for split, texts in buffers.items():
            if texts:
                submit(split, texts)
        while pending:
            done_split, result = pending.popleft()
            splits[done_split].append(result.get())
    finally:
        if pool is not None:
            pool.terminate()
            pool.join()
        _WORKER.pop("tok", None)
    if not seen:
        raise CorpusError(f"corpus {' '.join(map(str, corpus))!r} is empty (no non-blank text); give files that contain text")
    index = {
        "format": FORMAT, "version": VERSION, "dtype": dtype, "vocab_size": vocab_size, "bos_id": int(bos_id),
        "splits": {name: {"num_tokens": sum(e["num_tokens"] for e in entries),
                          "num_documents": sum(e["num_documents"] for e in entries),
                          "num_bytes": sum(e["num_bytes"] for e in entries),
                          "shards": sorted(entries, key=lambda e: e["file"])}
                   for name, entries in splits.items()},
    }
    if index["splits"]["train"]["num_tokens"] == 0:
        raise CorpusError(f"corpus {' '.join(map(str, corpus))!r} encodes to no training tokens; give more text")
    return index


def verify(folder: str | Path) -> dict[str, Any]:
    """Check every shard of a prepared folder against its index (sizes, counts, sha256); returns the index."""
    ds = ShardDataset(folder, verify=True)
    for name in ds.index["splits"]:
        ds.split(name)
    tok = Path(folder) / ds.index["tokenizer"]["file"]
    if not tok.is_file() or file_sha256(tok) != ds.index["tokenizer"]["sha256"]:
        raise CorpusError(f"{tok} is missing or does not match the sha256 in {Path(folder) / INDEX}; "
                          "run `lmkit data prepare` again into a fresh --out")
    return ds.index
