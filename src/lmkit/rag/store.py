"""A retrieval index folder: chunk embeddings in faiss, chunk texts in JSON, BM25 statistics, a manifest.

Dense search is by inner product of L2-normalized embeddings (cosine). The faiss index is exact
(IndexFlatIP) up to `approximate_above` chunks and an inverted file past it (IndexIVFFlat with
nlist = sqrt(N) centroids trained by k-means on at most 64 vectors per centroid, `nprobe` lists searched).
Both keep faiss ids, so documents are added and removed in place: only new chunks are embedded.

Layout: INDEX/manifest.json names the current generation INDEX/gen-NNNNNN/ (vectors.faiss, chunks.json,
bm25/). A save writes a whole new generation, then replaces manifest.json atomically, then deletes the old
generation: a reader, or a crash at any moment, sees the old index or the new one, never a mix.
The manifest keeps the fingerprints of the encoder's weights and of its tokenizer; an index is opened
only with the encoder it was built with.
"""
from __future__ import annotations

import hashlib
import json
import math
import shutil
import tempfile
from pathlib import Path

import numpy as np

from lmkit.atomic import atomic_save_file, atomic_write_json
from lmkit.errors import CheckpointError, ConfigError
from lmkit.progress import progress_bar
from lmkit.rag.chunks import Chunk, TokenCounter, check_sizes, chunk_document
from lmkit.rag.lexical import Lexical

FORMAT = "lmkit-rag-index"
VERSION = 1
APPROXIMATE_ABOVE = 200_000
EMBED_SLICE_BATCHES = 4  # encoder batches per progress update: each slice is still length-sorted within itself
TOKENIZER_FILES = ("tokenizer.json", "tokenizer_config.json", "vocab.txt", "vocab.json", "merges.txt",
                   "special_tokens_map.json", "spiece.model", "sentencepiece.bpe.model")


def fingerprints(encoder_dir) -> dict[str, str]:
    """sha256 of the encoder's tokenizer files and of every other weight and config file (pooling, Dense, ...)."""
    folder = Path(encoder_dir)
    tok, rest = hashlib.sha256(), hashlib.sha256()
    files = sorted(f for f in folder.rglob("*") if f.is_file() and f.suffix in (".json", ".safetensors", ".txt",
                                                                                   ".model", ".bin"))
    for f in files:
        h = tok if f.name in TOKENIZER_FILES else rest
        h.update(str(f.relative_to(folder)).encode() + b"\0")
        with f.open("rb") as fh:
            for block in iter(lambda: fh.read(1 << 20), b""):
                h.update(block)
    return {"tokenizer": tok.hexdigest(), "encoder": rest.hexdigest()}


def _faiss():
    import faiss

    return faiss


def flat_index(dim: int):
    faiss = _faiss()
    return faiss.IndexIDMap2(faiss.IndexFlatIP(dim))


def ivf_index(vectors: np.ndarray, ids: np.ndarray, nprobe: int, seed: int = 0):
    """IndexIVFFlat (inner product) trained on `vectors`, holding them under `ids`."""
    faiss = _faiss()
    dim = vectors.shape[1]
    nlist = max(1, min(int(math.sqrt(len(vectors))), len(vectors) // 39))
    quantizer = faiss.IndexFlatIP(dim)
    index = faiss.IndexIVFFlat(quantizer, dim, nlist, faiss.METRIC_INNER_PRODUCT)
    index.cp.seed = seed
    index.cp.max_points_per_centroid = 64  # a sample trains the centroids: k-means on 1M vectors would take minutes
    index.train(np.ascontiguousarray(vectors, dtype=np.float32))
    index.add_with_ids(np.ascontiguousarray(vectors, dtype=np.float32), ids.astype(np.int64))
    index.nprobe = min(nprobe, nlist)
    return index


def flat_vectors(index) -> tuple[np.ndarray, np.ndarray]:
    """(ids, vectors) of every entry of a flat (IndexIDMap2) index."""
    ids = _faiss().vector_to_array(index.id_map).astype(np.int64)
    return ids, index.index.reconstruct_n(0, index.ntotal)


class RagIndex:
    """Chunks of documents, their embeddings (faiss) and BM25 statistics, under one encoder."""

    def __init__(self, encoder, encoder_dir, settings: dict, index, chunks: dict[int, Chunk],
                 documents: dict[str, dict], next_id: int):
        self.encoder, self.encoder_dir, self.settings = encoder, str(encoder_dir), settings
        self.index, self.chunks, self.documents, self.next_id = index, chunks, documents, next_id
        self._lexical: tuple[Lexical, list[int]] | None = None

    # building -----------------------------------------------------------------------------------
    @classmethod
    def create(cls, encoder_dir, chunk_tokens: int = 128, overlap: int = 16, approximate_above: int = APPROXIMATE_ABOVE,
               nprobe: int = 16, dtype=None, batch_size: int = 64, device=None) -> "RagIndex":
        """A new, empty index under the encoder in encoder_dir, run in dtype on device (None: float32, the CPU)."""
        from lmkit.sentence import SentenceEncoder

        encoder = SentenceEncoder.from_pretrained(encoder_dir, dtype=dtype, device=device)
        specials = len(encoder.tokenizer.encode("", add_special_tokens=True))
        check_sizes(chunk_tokens, overlap, encoder.max_seq_length - specials)
        settings = {"chunk_tokens": chunk_tokens, "overlap": overlap, "approximate_above": approximate_above,
                    "nprobe": nprobe, "dim": encoder.dim, "batch_size": batch_size,
                    "fingerprint": fingerprints(encoder_dir)}
        return cls(encoder, encoder_dir, settings, flat_index(encoder.dim), {}, {}, 0)

    def __len__(self) -> int:
        return len(self.chunks)

    @property
    def approximate(self) -> bool:
        return not isinstance(self.index, _faiss().IndexIDMap2)

    def embed(self, texts: list[str]) -> np.ndarray:
        """Unit-length embeddings (cosine = inner product), float32."""
        if not texts:
            return np.zeros((0, self.settings["dim"]), np.float32)
        return np.ascontiguousarray(self.encoder.encode(texts, batch_size=self.settings["batch_size"],
                                                        normalize_embeddings=True), dtype=np.float32)

    def _embed_chunks(self, texts: list[str], progress: bool) -> np.ndarray:
        """embed(texts), in slices of a few batches so that a bar can count the chunks done."""
        if not progress:
            return self.embed(texts)
        step = EMBED_SLICE_BATCHES * self.settings["batch_size"]
        parts = []
        with progress_bar(total=len(texts), desc="embed", unit="chunk", dynamic_ncols=True) as bar:
            for i in range(0, len(texts), step):
                parts.append(self.embed(texts[i:i + step]))
                bar.update(len(parts[-1]))
        return np.concatenate(parts)

    def add(self, documents, progress: bool = False) -> dict[str, int]:
        """Index documents (objects with .id and .text); a document already present with other text is replaced,
        with the same text it is left as it is. Returns counts: added, replaced, unchanged, chunks.

        progress: bars on stderr (a terminal only) over the documents chunked, then the chunks embedded."""
        counter = TokenCounter(self.encoder.tokenizer)
        counts = {"added": 0, "replaced": 0, "unchanged": 0, "chunks": 0}
        new: list[Chunk] = []
        documents = list(documents)
        for doc in progress_bar(progress, iterable=documents, desc="chunk", unit="doc", dynamic_ncols=True):
            digest = hashlib.sha256(doc.text.encode("utf-8")).hexdigest()
            old = self.documents.get(doc.id)
            if old is not None and old["sha256"] == digest:
                counts["unchanged"] += 1
                continue
            if old is not None:
                self.remove([doc.id])
            counts["replaced" if old is not None else "added"] += 1
            pieces = chunk_document(doc.id, doc.text, counter, self.settings["chunk_tokens"], self.settings["overlap"])
            ids = list(range(self.next_id, self.next_id + len(pieces)))
            self.next_id += len(pieces)
            self.documents[doc.id] = {"sha256": digest, "chunks": ids}
            self.chunks.update(zip(ids, pieces))
            new.extend(pieces)
        if new:
            start = self.next_id - len(new)
            vectors = self._embed_chunks([c.text for c in new], progress)
            self.index.add_with_ids(vectors, np.arange(start, self.next_id, dtype=np.int64))
            self._lexical = None
        counts["chunks"] = len(new)
        self._maybe_approximate()
        return counts

    def remove(self, doc_ids) -> int:
        """Drop documents by id (an unknown id is an error); returns the number of chunks removed."""
        missing = [d for d in doc_ids if d not in self.documents]
        if missing:
            raise ConfigError(f"document {missing[0]!r} is not in the index; `lmkit rag query` shows the sources it has")
        ids = [i for d in doc_ids for i in self.documents.pop(d)["chunks"]]
        if ids:
            self.index.remove_ids(np.asarray(ids, dtype=np.int64))
            for i in ids:
                del self.chunks[i]
            self._lexical = None
        return len(ids)

    def _maybe_approximate(self) -> None:
        if not self.approximate and len(self.chunks) > self.settings["approximate_above"]:
            ids, vectors = flat_vectors(self.index)
            self.index = ivf_index(vectors, ids, self.settings["nprobe"])

    # searching ------------------------------------------------------------------------------------
    def dense(self, query: str, k: int) -> list[tuple[int, float]]:
        """(chunk id, cosine) of the k nearest chunks, best first."""
        return self.dense_vector(self.embed([query])[0], k)

    def dense_vector(self, vector: np.ndarray, k: int) -> list[tuple[int, float]]:
        k = min(k, len(self.chunks))
        if k < 1:
            return []
        scores, ids = self.index.search(np.ascontiguousarray(vector, dtype=np.float32).reshape(1, -1), k)
        return [(int(i), float(s)) for i, s in zip(ids[0], scores[0]) if i >= 0]

    def lexical(self) -> tuple[Lexical, list[int]]:
        """The BM25 index over the chunks in id order, and the chunk id of each of its rows."""
        if self._lexical is None:
            order = sorted(self.chunks)
            self._lexical = (Lexical.build([self.chunks[i].text for i in order]), order)
        return self._lexical

    def bm25(self, query: str, k: int) -> list[tuple[int, float]]:
        lexical, order = self.lexical()
        return [(order[row], score) for row, score in lexical.search(query, k)]

    # the folder -----------------------------------------------------------------------------------
    def save(self, path) -> None:
        folder = Path(path)
        if folder.exists() and not (folder / "manifest.json").is_file() and any(folder.iterdir()):
            raise ConfigError(f"{folder} is a folder that is not an lmkit index; give --out a new or empty folder")
        folder.mkdir(parents=True, exist_ok=True)
        old = _read_manifest(folder) if (folder / "manifest.json").is_file() else None
        generation = (old["generation"] + 1) if old else 1
        name = f"gen-{generation:06d}"
        tmp = Path(tempfile.mkdtemp(prefix=f".{name}.", suffix=".tmp", dir=folder))
        try:
            atomic_save_file(tmp / "vectors.faiss", lambda p: _faiss().write_index(self.index, p))
            order = sorted(self.chunks)
            rows = [self.chunks[i] for i in order]
            atomic_write_json(tmp / "chunks.json", {"ids": order, "source": [c.source for c in rows],
                                                    "n": [c.n for c in rows], "start": [c.start for c in rows],
                                                    "end": [c.end for c in rows], "text": [c.text for c in rows]},
                              indent=None)
            (tmp / "bm25").mkdir()
            self.lexical()[0].save(tmp / "bm25")
            if (folder / name).exists():  # left by a save that crashed before its manifest
                shutil.rmtree(folder / name)
            tmp.rename(folder / name)
        except BaseException:
            shutil.rmtree(tmp, ignore_errors=True)
            raise
        atomic_write_json(folder / "manifest.json", {
            "format": FORMAT, "version": VERSION, "generation": generation, "encoder": self.encoder_dir,
            **self.settings, "next_id": self.next_id, "count": len(self.chunks), "documents": self.documents})
        for stale in folder.glob("gen-*"):
            if stale.name != name:
                shutil.rmtree(stale, ignore_errors=True)

    @classmethod
    def open(cls, path, encoder_dir=None, dtype=None, device=None) -> "RagIndex":
        """Read an index folder with its encoder (by default the folder named in its manifest), run in dtype on
        device (None: float32, the CPU)."""
        from lmkit.sentence import SentenceEncoder

        folder = Path(path)
        manifest = _read_manifest(folder)
        encoder_dir = encoder_dir or manifest["encoder"]
        if not Path(encoder_dir).is_dir():
            raise CheckpointError(f"the encoder {encoder_dir} this index was built with is not there; pass --encoder DIR")
        got = fingerprints(encoder_dir)
        for part in ("tokenizer", "encoder"):
            if got[part] != manifest["fingerprint"][part]:
                raise CheckpointError(f"{folder} was built with another {part} than the one in {encoder_dir}; "
                                      "query it with the encoder it was built with, or rebuild it")
        gen = folder / f"gen-{manifest['generation']:06d}"
        try:
            data = json.loads((gen / "chunks.json").read_text(encoding="utf-8"))
            index = _faiss().read_index(str(gen / "vectors.faiss"))
            chunks = {i: Chunk(s, n, a, b, t) for i, s, n, a, b, t in zip(
                data["ids"], data["source"], data["n"], data["start"], data["end"], data["text"])}
            lexical = Lexical.load(gen / "bm25", len(chunks))
        except (OSError, ValueError, KeyError, TypeError, RuntimeError) as exc:
            raise CheckpointError(f"{folder} is damaged ({type(exc).__name__} reading {gen.name}); rebuild it with "
                                  "`lmkit rag index`") from None
        if index.ntotal != len(chunks) or len(chunks) != manifest["count"] or index.d != manifest["dim"]:
            raise CheckpointError(f"{folder} is damaged ({index.ntotal} vectors for {len(chunks)} chunks); rebuild it "
                                  "with `lmkit rag index`")
        encoder = SentenceEncoder.from_pretrained(encoder_dir, dtype=dtype, device=device)
        settings = {key: manifest[key] for key in ("chunk_tokens", "overlap", "approximate_above", "nprobe", "dim",
                                                   "batch_size", "fingerprint")}
        out = cls(encoder, encoder_dir, settings, index, chunks, manifest["documents"], manifest["next_id"])
        out._lexical = (lexical, sorted(chunks))
        return out


def _read_manifest(folder: Path) -> dict:
    path = folder / "manifest.json"
    if not folder.is_dir():
        raise CheckpointError(f"{folder} is not a folder; build an index there with `lmkit rag index`")
    try:
        manifest = json.loads(path.read_text(encoding="utf-8"))
        if manifest.get("format") != FORMAT:
            raise ValueError("not an lmkit index")
        if manifest.get("version") != VERSION:
            raise CheckpointError(f"{folder} is an index of format version {manifest.get('version')}; this lmkit "
                                  f"reads version {VERSION}: rebuild it with `lmkit rag index`")
        int(manifest["generation"]), manifest["fingerprint"]["encoder"], manifest["documents"]
    except FileNotFoundError:
        raise CheckpointError(f"{path} is missing: {folder} is not an lmkit index (or is damaged); build it with "
                              "`lmkit rag index`") from None
    except (ValueError, KeyError, TypeError) as exc:
        raise CheckpointError(f"{path} is damaged ({exc}); rebuild the index with `lmkit rag index`") from None
    return manifest
