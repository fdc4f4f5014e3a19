"""Token shards: a folder of safetensors files read through memory maps, named by a JSON index.

Layout of a prepared folder (written by `lmkit.data.prepare`):

    index.json                         what is there: dtype, vocabulary, splits, each shard's counts and sha256
    tokenizer.json                     the tokenizer that produced the ids
    train-00000.safetensors ...        tensors "tokens" (uint16 when the vocabulary has at most 65536 ids,
    validation-00000.safetensors ...   else uint32), "doc_offsets" (int64, n + 1) and "doc_bytes" (int64, n)

`tokens` holds every document preceded by the separator id (BOS): sep d_1 sep d_2 ... and
`doc_offsets[i]` is where document i's separator sits. A split is the concatenation of its
shards, read as one stream without loading it: `np.memmap` over the data section of each
safetensors file (its layout: 8-byte little-endian header length, JSON header, raw bytes).

Training rows (`ShardStream`): the stream is cut into R = (N - 1) // seq_len rows of seq_len + 1
tokens, row j = stream[j * seq_len : j * seq_len + seq_len + 1]. Global row g of the run is row
perm_e(g mod R) with e = g // R the epoch and perm_e a permutation seeded by (seed, e). Step s
reads global rows s*B .. s*B + B - 1 and rank r of w takes the contiguous slice r*B/w .. (r+1)*B/w - 1:
the data position is a pure function of the step, so a resumed run reads exactly what it would have.
"""
from __future__ import annotations

import bisect
import hashlib
import json
import struct
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import numpy as np

from lmkit.data.stream import TokenizedCorpus
from lmkit.data.tokenize import vocab_size_of
from lmkit.errors import CorpusError
from lmkit.tokenizers import load_tokenizer

INDEX = "index.json"
TOKENIZER = "tokenizer.json"
FORMAT = "lmkit-token-shards"
VERSION = 1
DTYPES = {"uint16": ("U16", np.uint16), "uint32": ("U32", np.uint32)}
SAFETENSORS_DTYPES = {"U16": np.uint16, "U32": np.uint32, "I64": np.int64}


def token_dtype(vocab_size: int) -> str:
    """'uint16' when every id fits in 16 bits (vocab_size <= 65536), else 'uint32'."""
    if vocab_size <= 0:
        raise CorpusError(f"a tokenizer with {vocab_size} ids cannot produce shards")
    return "uint16" if vocab_size <= 1 << 16 else "uint32"


def file_sha256(path: str | Path, block: int = 1 << 22) -> str:
    h = hashlib.sha256()
    with open(path, "rb") as f:
        while chunk := f.read(block):
            h.update(chunk)
    return h.hexdigest()


def _fail(path: Path, what: str, fix: str = "run `lmkit data prepare` again into a fresh --out") -> CorpusError:
    return CorpusError(f"{path}: {what}; {fix}")


def read_header(path: Path) -> tuple[dict[str, Any], int]:
    """(safetensors header, offset of the data section): the file's layout, checked against its size."""
    size = path.stat().st_size
    with open(path, "rb") as f:
        head = f.read(8)
        if len(head) < 8:
            raise _fail(path, "is truncated (no safetensors header)")
        (n,) = struct.unpack("<Q", head)
        if n > min(size - 8, 100_000_000):
            raise _fail(path, "has a damaged safetensors header")
        try:
            header = json.loads(f.read(n).decode("utf-8"))
        except (UnicodeDecodeError, ValueError):
            raise _fail(path, "has a damaged safetensors header") from None
    if not isinstance(header, dict):
        raise _fail(path, "has a damaged safetensors header")
    data_start = 8 + n
    end = 0
    for name, info in header.items():
        if name == "__metadata__":
            continue
        try:
            begin, stop = info["data_offsets"]
            dtype = SAFETENSORS_DTYPES[info["dtype"]]
            count = int(np.prod(info["shape"], dtype=np.int64))
        except (KeyError, TypeError, ValueError):
            raise _fail(path, f"describes tensor {name!r} in a way lmkit does not read") from None
        if stop - begin != count * np.dtype(dtype).itemsize:
            raise _fail(path, f"tensor {name!r} has a size that does not match its shape")
        end = max(end, stop)
    if data_start + end != size:
        raise _fail(path, f"is {size} bytes but its header describes {data_start + end} (truncated or padded)")
    return header, data_start


def memmap_tensor(path: Path, header: dict, data_start: int, name: str) -> np.ndarray:
    """Tensor `name` of a safetensors file as a read-only memory map (nothing is read yet)."""
    if name not in header:
        raise _fail(path, f"has no tensor {name!r}")
    info = header[name]
    dtype = SAFETENSORS_DTYPES[info["dtype"]]
    begin, stop = info["data_offsets"]
    count = (stop - begin) // np.dtype(dtype).itemsize
    if count == 0:
        return np.zeros(0, dtype=dtype)
    return np.memmap(path, dtype=dtype, mode="r", offset=data_start + begin, shape=(count,))


@dataclass
class Shard:
    """One safetensors file of a split, memory-mapped."""

    path: Path
    tokens: np.ndarray
    doc_offsets: np.ndarray
    doc_bytes: np.ndarray

    @property
    def num_tokens(self) -> int:
        return len(self.tokens)


def open_shard(path: Path, entry: dict[str, Any], dtype: str, verify: bool) -> Shard:
    """Open a shard and check it against its index entry (size, counts, dtype; sha256 when verify)."""
    if not path.is_file():
        raise _fail(path, f"is named in {INDEX} but missing")
    if path.stat().st_size != entry["size"]:
        raise _fail(path, f"is {path.stat().st_size} bytes but {INDEX} says {entry['size']} (truncated or replaced)")
    if verify and file_sha256(path) != entry["sha256"]:
        raise _fail(path, f"does not match the sha256 in {INDEX} (damaged or replaced)")
    header, start = read_header(path)
    tokens = memmap_tensor(path, header, start, "tokens")
    if tokens.dtype != DTYPES[dtype][1]:
        raise _fail(path, f"holds {tokens.dtype} ids but {INDEX} says {dtype}")
    offsets = np.asarray(memmap_tensor(path, header, start, "doc_offsets"))
    nbytes = np.asarray(memmap_tensor(path, header, start, "doc_bytes"))
    if len(tokens) != entry["num_tokens"] or len(nbytes) != entry["num_documents"] or len(offsets) != len(nbytes) + 1:
        raise _fail(path, f"holds {len(tokens)} tokens / {len(nbytes)} documents but {INDEX} says "
                          f"{entry['num_tokens']} / {entry['num_documents']}")
    return Shard(path, tokens, offsets, nbytes)


class TokenSplit:
    """The shards of one split read as one stream of ids: `split[a:b]` copies only that range."""

    def __init__(self, folder: Path, name: str, info: dict[str, Any], dtype: str, verify: bool):
        self.name = name
        self.shards = [open_shard(folder / e["file"], e, dtype, verify) for e in info["shards"]]
        self.starts = np.cumsum([0] + [s.num_tokens for s in self.shards]).tolist()
        self.num_tokens = self.starts[-1]
        self.num_documents = sum(len(s.doc_bytes) for s in self.shards)
        self.num_bytes = sum(int(s.doc_bytes.sum()) for s in self.shards)

    def __len__(self) -> int:
        return self.num_tokens

    def __getitem__(self, key: slice) -> np.ndarray:
        start, stop, step = key.indices(self.num_tokens)
        if step != 1:
            raise ValueError("TokenSplit supports contiguous slices only")
        parts, pos = [], start
        while pos < stop:
            k = bisect.bisect_right(self.starts, pos) - 1
            shard_end = self.starts[k + 1]
            take = min(stop, shard_end) - pos
            local = pos - self.starts[k]
            parts.append(np.asarray(self.shards[k].tokens[local:local + take]))
            pos += take
        return np.concatenate(parts) if len(parts) != 1 else parts[0].copy()

    def documents(self):
        """(ids without the separator, UTF-8 bytes) of each document, in order (for evaluation)."""
        for s in self.shards:
            for i in range(len(s.doc_bytes)):
                yield np.asarray(s.tokens[s.doc_offsets[i] + 1:s.doc_offsets[i + 1]]), int(s.doc_bytes[i])


class ShardDataset:
    """A prepared folder: its index, tokenizer path and splits (opened lazily, checked on open)."""

    def __init__(self, folder: str | Path, verify: bool = True):
        self.folder = Path(folder)
        self.verify = verify
        self.index = read_index(self.folder)
        self.dtype = self.index["dtype"]
        self.vocab_size = int(self.index["vocab_size"])
        self.bos_id = int(self.index["bos_id"])
        self._splits: dict[str, TokenSplit] = {}

    @property
    def tokenizer_path(self) -> Path:
        return self.folder / self.index["tokenizer"]["file"]

    def split(self, name: str = "train") -> TokenSplit:
        if name not in self.index["splits"]:
            raise CorpusError(f"{self.folder / INDEX} has no {name!r} split; it has {', '.join(self.index['splits'])}")
        if name not in self._splits:
            self._splits[name] = TokenSplit(self.folder, name, self.index["splits"][name], self.dtype, self.verify)
        return self._splits[name]

    def has_split(self, name: str) -> bool:
        return self.index["splits"].get(name, {}).get("num_tokens", 0) > 0


def read_index(folder: Path) -> dict[str, Any]:
    """index.json of a prepared folder, with every field the readers rely on checked."""
    path = Path(folder) / INDEX
    if not Path(folder).is_dir():
        raise CorpusError(f"{folder} is not a folder; prepare one with `lmkit data prepare --corpus ... --tokenizer ... --out {folder}`")
    if not path.is_file():
        raise _fail(path, "is missing", f"prepare the folder with `lmkit data prepare --out {folder}`")
    try:
        index = json.loads(path.read_text(encoding="utf-8"))
    except (UnicodeDecodeError, ValueError) as exc:
        raise _fail(path, f"is not valid JSON ({exc})") from None
    try:
        if index["format"] != FORMAT or index["version"] != VERSION:
            raise _fail(path, f"is not a {FORMAT} v{VERSION} index")
        if index["dtype"] not in DTYPES:
            raise _fail(path, f"names dtype {index['dtype']!r}; expected uint16 or uint32")
        if index["dtype"] == "uint16" and int(index["vocab_size"]) > 1 << 16:
            raise _fail(path, f"stores uint16 ids for a vocabulary of {index['vocab_size']}")
        int(index["bos_id"])
        str(index["tokenizer"]["file"])
        for name, split in index["splits"].items():
            total = 0
            for e in split["shards"]:
                if not isinstance(e["file"], str) or "/" in e["file"] or e["file"].startswith("."):
                    raise _fail(path, f"names shard file {e['file']!r}, which is not a plain file name")
                total += int(e["num_tokens"])
                int(e["size"]), int(e["num_documents"]), str(e["sha256"])
            if total != int(split["num_tokens"]):
                raise _fail(path, f"split {name!r} says {split['num_tokens']} tokens but its shards hold {total}")
    except (KeyError, TypeError, ValueError, AttributeError) as exc:
        raise _fail(path, f"lacks or mangles a field ({exc!r})") from None
    return index


def prepared_fingerprint(folder: str | Path) -> str:
    """sha256 naming the content of a prepared folder (every split's shards by their sha256), not its path."""
    splits = read_index(Path(folder))["splits"]
    return hashlib.sha256(json.dumps(splits, sort_keys=True).encode("utf-8")).hexdigest()


class ShardStream:
    """Training rows from a prepared split (see the module docstring): rows(seed, step, B, rank, w)."""

    def __init__(self, split: TokenSplit, seq_len: int):
        if seq_len < 1:
            raise CorpusError(f"seq_len must be positive, got {seq_len}")
        self.split, self.seq_len = split, seq_len
        self.num_rows = (split.num_tokens - 1) // seq_len
        if self.num_rows < 1:
            raise CorpusError(f"split {split.name!r} holds {split.num_tokens} tokens, fewer than one row of "
                              f"{seq_len + 1}; prepare more text or lower --seq-len")
        self._perm: tuple[int, int, np.ndarray] | None = None

    @property
    def num_tokens(self) -> int:
        return self.split.num_tokens

    def _permutation(self, seed: int, epoch: int) -> np.ndarray:
        if self._perm is None or self._perm[:2] != (seed, epoch):
            rng = np.random.Generator(np.random.PCG64([seed & 0xFFFFFFFF, epoch, 0x1A2B]))
            dtype = np.uint32 if self.num_rows < 1 << 32 else np.int64  # 4 bytes a row: 0.4% of uint16 ids at seq_len 512
            order = np.arange(self.num_rows, dtype=dtype)
            rng.shuffle(order)
            self._perm = (seed, epoch, order)
        return self._perm[2]

    def row_indices(self, seed: int, first: int, count: int) -> list[int]:
        """Rows of the split read by global rows first .. first + count - 1."""
        out = []
        for g in range(first, first + count):
            epoch, k = divmod(g, self.num_rows)
            out.append(int(self._permutation(seed, epoch)[k]))
        return out

    def rows(self, seed: int, step: int, batch_size: int, rank: int = 0, world_size: int = 1):
        """This rank's (batch_size / world_size, seq_len + 1) int64 rows of optimizer step `step`."""
        import torch

        if batch_size % world_size:
            raise CorpusError(f"--batch-size {batch_size} is not divisible by the {world_size} processes; pick a multiple")
        per = batch_size // world_size
        first = step * batch_size + rank * per
        rows = [self.split[j * self.seq_len:j * self.seq_len + self.seq_len + 1] for j in self.row_indices(seed, first, per)]
        return torch.from_numpy(np.stack(rows).astype(np.int64))


MAX_VAL_TOKENS = 1 << 19


def open_prepared(folder: str | Path, seq_len: int, verify: bool = True, max_val_tokens: int = MAX_VAL_TOKENS):
    """(tokenizer, ShardStream of the train split, validation TokenizedCorpus) of a prepared folder.

    Evaluation reads the first validation documents up to `max_val_tokens` ids (at least one document),
    so memory and evaluation time stay bounded however large the corpus is.
    """
    ds = ShardDataset(folder, verify=verify)
    tok_path = ds.tokenizer_path
    if not tok_path.is_file():
        raise _fail(tok_path, f"is named in {INDEX} but missing")
    if verify and file_sha256(tok_path) != ds.index["tokenizer"]["sha256"]:
        raise _fail(tok_path, f"is not the tokenizer the shards were made with (sha256 differs from {INDEX})")
    tok = load_tokenizer(tok_path)
    if vocab_size_of(tok) != ds.vocab_size:
        raise _fail(tok_path, f"has {vocab_size_of(tok)} ids but the shards were made with {ds.vocab_size}")
    train = ShardStream(ds.split("train"), seq_len)  # opened (and checked) first: its shards matter most
    if not ds.has_split("validation"):
        raise _fail(Path(folder) / INDEX, "has no validation documents to evaluate on",
                    "prepare it again with --val-fraction above 0 (e.g. 0.05)")
    docs, total = [], 0
    for ids, n in ds.split("validation").documents():
        if docs and total + len(ids) > max_val_tokens:
            break
        docs.append((ids, n))
        total += len(ids)
    ids, nbytes = zip(*docs)
    lengths = np.array([len(x) for x in ids], dtype=np.int64)
    val = TokenizedCorpus(np.concatenate(ids).astype(np.int32), np.concatenate([[0], np.cumsum(lengths)]).astype(np.int64),
                          np.array(nbytes, dtype=np.int64))
    return tok, train, val
