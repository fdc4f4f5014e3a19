"""Cleaning a corpus before training, with a report of what was removed and why.

Two passes over the documents. Pass 1 counts, for every line of at least `boilerplate_min_chars`
characters (stripped), the number of documents it appears in; lines found in at least
`boilerplate_min_docs` documents are boilerplate (licence headers, navigation, footers). Pass 2,
per document in order: drop boilerplate lines; filter by length (characters, words), by
character classes over the non-space characters (letters >= min_alpha, digits <= max_digit,
control / private-use / unassigned / U+FFFD <= max_bad) and, if asked, by language (`language.py`); drop exact duplicates (sha256 of the
text); drop near duplicates by MinHash with LSH:

- shingles S(d) are the n-grams of lower-cased words; MinHash signature sig_j(d) = min_{s in S(d)} h_j(s)
  with h_j(x) = ((a_j x + b_j) mod 2^64) >> 32 (multiply-shift hashing, a_j odd), j = 1..P;
  P(sig_j(A) = sig_j(B)) = J(A, B) = |A n B| / |A u B|, so the share of equal entries estimates J.
- LSH: the P entries are cut into b bands of r rows; two documents are candidates when some band is
  equal, which happens with probability 1 - (1 - J^r)^b (an S-curve around (1/b)^(1/r)).
- a candidate whose estimated J >= near_threshold against an earlier kept document is removed.
"""
from __future__ import annotations

import hashlib
import json
import zlib
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import Any, Callable, Iterable, Iterator

import numpy as np
import regex

from lmkit.atomic import atomic_open, atomic_write_json
from lmkit.data.corpus import Corpus, Document, refuse_inputs
from lmkit.data.language import detect_language
from lmkit.data.prepare import stream_documents
from lmkit.errors import CorpusError

WORD = regex.compile(r"\w+")
LETTER = regex.compile(r"\p{L}")
DIGIT = regex.compile(r"\p{Nd}")
BAD = regex.compile(r"[\p{Cc}\p{Co}\p{Cn}\p{Cs}\uFFFD--[\t\n\r]]", regex.V1)
NONSPACE = regex.compile(r"\S")
REASONS = ("too_short", "too_long", "too_few_words", "few_letters", "many_digits", "bad_characters",
           "other_language", "exact_duplicate", "near_duplicate")
FLAGS = {"too_short": "--min-chars", "too_long": "--max-chars", "too_few_words": "--min-words",
         "few_letters": "--min-alpha", "many_digits": "--max-digit", "bad_characters": "--max-bad",
         "other_language": "--languages", "near_duplicate": "--near-threshold"}  # the flag that loosens each filter


@dataclass
class CleanConfig:
    min_chars: int = 20
    max_chars: int | None = None
    min_words: int = 3
    min_alpha: float = 0.25
    max_digit: float = 0.5
    max_bad: float = 0.001
    languages: tuple[str, ...] | None = None  # ISO 639-1 codes to keep (data/language.py); None: every language
    boilerplate_min_docs: int = 5      # 0: keep every line
    boilerplate_min_chars: int = 20
    dedup_exact: bool = True
    near_threshold: float | None = 0.8  # None: no near-duplicate removal
    num_perm: int = 128
    bands: int = 16
    shingle: int = 5
    seed: int = 0
    max_listed: int = 1000             # removed documents listed per reason in the report (counts are exact)

    def check(self) -> None:
        for flag, value, least in (("--min-chars", self.min_chars, 0), ("--max-chars", self.max_chars, 1),
                                   ("--min-words", self.min_words, 0), ("--num-perm", self.num_perm, 1),
                                   ("--bands", self.bands, 1), ("--boilerplate-min-docs", self.boilerplate_min_docs, 0),
                                   ("--boilerplate-min-chars", self.boilerplate_min_chars, 1)):
            if value is not None and value < least:
                raise CorpusError(f"{flag} must be at least {least}, got {value}")
        if self.num_perm % self.bands:
            raise CorpusError(f"--num-perm {self.num_perm} must be a multiple of --bands {self.bands}")
        if self.near_threshold is not None and not 0.0 < self.near_threshold <= 1.0:
            raise CorpusError(f"--near-threshold must lie in (0, 1], got {self.near_threshold}")
        if self.shingle < 1:
            raise CorpusError(f"--shingle must be at least 1, got {self.shingle}")
        for flag, share in (("--min-alpha", self.min_alpha), ("--max-digit", self.max_digit), ("--max-bad", self.max_bad)):
            if not 0.0 <= share <= 1.0:  # a share outside [0, 1] silently keeps or removes every document
                raise CorpusError(f"{flag} is a share of characters and must lie in [0, 1], got {share}")


# MinHash and LSH ---------------------------------------------------------------------------------

def _hash64(text: str) -> int:
    return int.from_bytes(hashlib.blake2b(text.encode("utf-8"), digest_size=8).digest(), "little")


def shingles(text: str, n: int) -> np.ndarray:
    """Distinct 64-bit hashes of the word n-grams of text (lower-cased); one gram when fewer than n words."""
    words = WORD.findall(text.lower())
    if not words:
        return np.zeros(0, dtype=np.uint64)
    w = np.array([zlib.crc32(x.encode("utf-8")) for x in words], dtype=np.uint64)
    m = max(1, len(w) - n + 1)
    h = np.zeros(m, dtype=np.uint64)
    for k in range(min(n, len(w))):  # polynomial hash sum_k w[i + k] * P^(n-1-k) mod 2^64
        h = h * np.uint64(0x100000001B3) + w[k:k + m]
    return np.unique(h)


class MinHasher:
    """P hash functions h_j(x) = ((a_j x + b_j) mod 2^64) >> 32 and the signature min_s h_j(s)."""

    def __init__(self, num_perm: int = 128, seed: int = 0):
        rng = np.random.Generator(np.random.PCG64(seed))
        self.a = (rng.integers(0, 1 << 63, num_perm, dtype=np.uint64) << np.uint64(1)) | np.uint64(1)
        self.b = rng.integers(0, 1 << 63, num_perm, dtype=np.uint64)
        self.num_perm = num_perm

    def signature(self, hashes: np.ndarray) -> np.ndarray:
        sig = np.full(self.num_perm, np.iinfo(np.uint32).max, dtype=np.uint32)
        for start in range(0, len(hashes), 4096):  # bounded (P, 4096) temporaries for long documents
            block = hashes[start:start + 4096]
            values = ((self.a[:, None] * block[None, :] + self.b[:, None]) >> np.uint64(32)).astype(np.uint32)
            sig = np.minimum(sig, values.min(axis=1))
        return sig


def jaccard(a: np.ndarray, b: np.ndarray) -> float:
    """Estimated Jaccard similarity: the share of equal signature entries."""
    return float(np.mean(a == b))


class LSHIndex:
    """Bands of a signature as bucket keys; `query` gives earlier documents sharing any bucket."""

    def __init__(self, num_perm: int, bands: int):
        self.bands, self.rows = bands, num_perm // bands
        self.buckets: dict[int, list[int]] = {}
        self.signatures: list[np.ndarray] = []

    def _keys(self, sig: np.ndarray) -> list[int]:
        return [hash((i, sig[i * self.rows:(i + 1) * self.rows].tobytes())) for i in range(self.bands)]

    def query(self, sig: np.ndarray) -> list[int]:
        found: set[int] = set()
        for key in self._keys(sig):
            found.update(self.buckets.get(key, ()))
        return sorted(found)

    def add(self, sig: np.ndarray) -> int:
        k = len(self.signatures)
        self.signatures.append(sig)
        for key in self._keys(sig):
            self.buckets.setdefault(key, []).append(k)
        return k


# the cleaner ---------------------------------------------------------------------------------------

def _lines_key(line: str) -> str:
    return line.strip()


class Cleaner:
    """Runs the two passes; `report()` says what was removed and why."""

    def __init__(self, config: CleanConfig | None = None):
        self.config = config or CleanConfig()
        self.config.check()
        self.boilerplate: set[int] = set()
        self.minhash = MinHasher(self.config.num_perm, self.config.seed)
        self.lsh = LSHIndex(self.config.num_perm, self.config.bands)
        self.lsh_ids: list[str] = []
        self.exact: dict[bytes, str] = {}
        self.counts = {r: 0 for r in REASONS}
        self.listed: dict[str, list[dict[str, Any]]] = {r: [] for r in REASONS}
        self.docs_in = self.docs_out = self.chars_in = self.chars_out = 0
        self.lines_removed = self.docs_touched = 0
        self.line_examples: dict[int, list] = {}

    def count_lines(self, documents: Iterable[Document]) -> None:
        """Pass 1: the set of boilerplate line hashes (lines in >= boilerplate_min_docs documents)."""
        c = self.config
        if c.boilerplate_min_docs <= 0:
            return
        hashes = np.zeros(0, dtype=np.uint64)
        counts = np.zeros(0, dtype=np.int64)
        buffer: list[int] = []

        def merge() -> tuple[np.ndarray, np.ndarray]:
            allh = np.concatenate([hashes, np.array(buffer, dtype=np.uint64)])
            allc = np.concatenate([counts, np.ones(len(buffer), dtype=np.int64)])
            uniq, inverse = np.unique(allh, return_inverse=True)
            return uniq, np.bincount(inverse, weights=allc, minlength=len(uniq)).astype(np.int64)

        for doc in documents:
            buffer.extend({_hash64(k) for line in doc.text.split("\n")
                           if len(k := _lines_key(line)) >= c.boilerplate_min_chars})
            if len(buffer) > 1 << 20:
                hashes, counts = merge()
                buffer = []
        hashes, counts = merge()
        self.boilerplate = set(hashes[counts >= c.boilerplate_min_docs].tolist())

    def _remove(self, doc: Document, reason: str, **detail: Any) -> None:
        self.counts[reason] += 1
        if len(self.listed[reason]) < self.config.max_listed:
            self.listed[reason].append({"id": doc.id, **detail})

    def _strip_boilerplate(self, text: str) -> str:
        if not self.boilerplate:
            return text
        kept, removed = [], 0
        for line in text.split("\n"):
            key = _lines_key(line)
            if len(key) >= self.config.boilerplate_min_chars and (h := _hash64(key)) in self.boilerplate:
                removed += 1
                entry = self.line_examples.setdefault(h, [key, 0])
                entry[1] += 1
            else:
                kept.append(line)
        if removed:
            self.lines_removed += removed
            self.docs_touched += 1
            return "\n".join(kept)
        return text

    def _filter_reason(self, text: str) -> tuple[str, dict] | None:
        c = self.config
        n = len(text.strip())
        if n < c.min_chars:
            return "too_short", {"chars": n}
        if c.max_chars is not None and n > c.max_chars:
            return "too_long", {"chars": n}
        words = len(WORD.findall(text))
        if words < c.min_words:
            return "too_few_words", {"words": words}
        visible = max(1, len(NONSPACE.findall(text)))
        alpha = len(LETTER.findall(text)) / visible
        if alpha < c.min_alpha:
            return "few_letters", {"letters": round(alpha, 4)}
        digits = len(DIGIT.findall(text)) / visible
        if digits > c.max_digit:
            return "many_digits", {"digits": round(digits, 4)}
        bad = len(BAD.findall(text)) / visible
        if bad > c.max_bad:
            return "bad_characters", {"bad": round(bad, 4)}
        if c.languages is not None:
            language = detect_language(text)
            if language not in c.languages:
                return "other_language", {"language": language}
        return None

    def process(self, doc: Document) -> Document | None:
        """Pass 2 for one document: the cleaned document, or None (and the reason recorded)."""
        c = self.config
        self.docs_in += 1
        self.chars_in += len(doc.text)
        text = self._strip_boilerplate(doc.text)
        reason = self._filter_reason(text)
        if reason is not None:
            self._remove(doc, reason[0], **reason[1])
            return None
        if c.dedup_exact:
            digest = hashlib.sha256(text.encode("utf-8")).digest()
            if digest in self.exact:
                self._remove(doc, "exact_duplicate", of=self.exact[digest])
                return None
            self.exact[digest] = doc.id
        if c.near_threshold is not None:
            sig = self.minhash.signature(shingles(text, c.shingle))
            for k in self.lsh.query(sig):
                j = jaccard(sig, self.lsh.signatures[k])
                if j >= c.near_threshold:
                    self._remove(doc, "near_duplicate", of=self.lsh_ids[k], jaccard=round(j, 4))
                    return None
            self.lsh.add(sig)
            self.lsh_ids.append(doc.id)
        self.docs_out += 1
        self.chars_out += len(text)
        return doc if text is doc.text else Document(doc.id, text)

    def report(self) -> dict[str, Any]:
        top = sorted(self.line_examples.values(), key=lambda e: -e[1])[:50]
        return {
            "documents_in": self.docs_in, "documents_kept": self.docs_out,
            "documents_removed": self.docs_in - self.docs_out,
            "chars_in": self.chars_in, "chars_kept": self.chars_out,
            "removed": dict(self.counts),
            "boilerplate": {"distinct_lines": len(self.boilerplate), "lines_removed": self.lines_removed,
                            "documents_touched": self.docs_touched,
                            "top_lines": [{"line": line, "removed": n} for line, n in top]},
            "removed_documents": {r: v for r, v in self.listed.items() if v},
            "config": asdict(self.config),
        }


def clean_stream(documents: Callable[[], Iterable[Document]], config: CleanConfig | None = None
                 ) -> tuple[Iterator[Document], Cleaner]:
    """(kept documents, cleaner): `documents()` is called twice (boilerplate pass, then cleaning)."""
    cleaner = Cleaner(config)
    cleaner.count_lines(documents())

    def kept() -> Iterator[Document]:
        for doc in documents():
            out = cleaner.process(doc)
            if out is not None:
                yield out

    return kept(), cleaner


def clean_corpus(corpus: Corpus, config: CleanConfig | None = None) -> tuple[Corpus, dict[str, Any]]:
    """The cleaned corpus (documents in order) and the report."""
    kept, cleaner = clean_stream(lambda: corpus.documents, config)
    docs = list(kept)
    return Corpus(corpus.name, docs), cleaner.report()


def clean_files(specs: list[str], out: str, report_path: str | None = None,
                config: CleanConfig | None = None) -> dict[str, Any]:
    """Clean corpus specs into a JSONL file ({"id", "text"} per line, written atomically) plus a JSON report."""
    report_path = report_path or f"{out}.report.json"
    _check_outputs(specs, out, report_path)
    kept, cleaner = clean_stream(lambda: stream_documents(specs), config)
    with atomic_open(out, "w", encoding="utf-8") as f:
        for doc in kept:
            f.write(json.dumps({"id": doc.id, "text": doc.text}, ensure_ascii=False) + "\n")
        if cleaner.docs_in == 0:
            raise CorpusError(f"corpus {' '.join(specs)!r} is empty (no non-blank text); give files that contain text")
        if cleaner.docs_out == 0:  # an empty output would only fail later, in training
            removed = ", ".join(f"{n} {r.replace('_', ' ')}" + (f" ({FLAGS[r]})" if r in FLAGS else "")
                                for r, n in cleaner.counts.items() if n)
            raise CorpusError(f"no document of {' '.join(specs)!r} survives cleaning (of {cleaner.docs_in}: {removed}); "
                              "loosen the filters named here; nothing was written")
    report = cleaner.report()
    atomic_write_json(report_path, report)
    return report


def _check_outputs(specs: list[str], out: str, report_path: str) -> None:
    """Refuse outputs that would replace an input file or each other (the atomic rename would destroy it)."""
    out_path, rep_path = (str(Path(p).expanduser().resolve()) for p in (out, report_path))
    if out_path == rep_path:
        raise CorpusError(f"--report {report_path} is the --out file; give the report its own name")
    refuse_inputs(specs, {"--out": out, "--report": report_path})
