"""Cleaning: exact and near duplicates (MinHash + LSH), length and character-class filters, boilerplate lines."""
import json
import math
import subprocess
import sys

import numpy as np
import pytest

from lmkit.cli import main
from lmkit.data.clean import CleanConfig, LSHIndex, MinHasher, clean_corpus, jaccard, shingles
from lmkit.data.corpus import Corpus, Document, load_corpus

RNG = np.random.default_rng(0)
VOCAB = [f"word{i}" for i in range(3000)]


def prose(n, rng=RNG):
    return " ".join(rng.choice(VOCAB, size=n)) + "."


def test_minhash_estimates_jaccard():
    """P(sig_j(A) = sig_j(B)) = J(A, B): the share of equal entries is within 4 sigma of J."""
    mh = MinHasher(num_perm=256, seed=1)
    for j_true in (0.1, 0.5, 0.8, 0.95):
        inter = int(round(1000 * j_true))
        a = np.arange(1000, dtype=np.uint64)
        b = np.arange(1000 - inter, 2000 - inter, dtype=np.uint64)  # |A n B| = inter, |A u B| = 2000 - inter
        j = inter / (2000 - inter)
        est = jaccard(mh.signature(a * np.uint64(0x9E3779B97F4A7C15)), mh.signature(b * np.uint64(0x9E3779B97F4A7C15)))
        assert abs(est - j) < 4 * math.sqrt(j * (1 - j) / 256) + 1e-9


def test_lsh_candidate_rate_follows_the_s_curve():
    """Signatures agreeing entrywise with probability s collide in some band with P = 1 - (1 - s^r)^b."""
    rng = np.random.default_rng(2)
    bands, rows = 16, 8
    for s in (0.5, 0.7, 0.85):
        index = LSHIndex(bands * rows, bands)
        hits, trials = 0, 400
        for _ in range(trials):
            a = rng.integers(0, 2**32, bands * rows, dtype=np.uint64).astype(np.uint32)
            b = np.where(rng.random(bands * rows) < s, a, rng.integers(0, 2**32, bands * rows).astype(np.uint32))
            index.buckets.clear(), index.signatures.clear()
            index.add(a)
            hits += bool(index.query(b))
        p = 1 - (1 - s**rows) ** bands
        assert abs(hits / trials - p) < 4 * math.sqrt(p * (1 - p) / trials) + 0.01


def test_shingles_ignore_case_and_punctuation():
    assert np.array_equal(shingles("The cat, sat on THE mat!", 3), shingles("the cat sat on the mat", 3))
    assert len(shingles("a b c d e", 3)) == 3 and len(shingles("a b", 5)) == 1 and len(shingles("...", 5)) == 0


def test_duplicates_filters_and_report():
    base = prose(200)
    words = base.split()
    near = " ".join(words[:100] + ["changed"] + words[101:])  # one word of 200 changed: J ~ 0.95
    docs = [
        Document("orig", base),
        Document("copy", base),
        Document("near", near),
        Document("other", prose(200)),
        Document("short", "tiny"),
        Document("numbers", "abc12345 " * 10),
        Document("symbols", "{}[]();:+-*/=<>!@#$%^&" * 10 + " a b c"),
        Document("control", prose(40) + "\x00\x01\x02"),
        Document("few", "supercalifragilistic expialidocious"),
    ]
    out, report = clean_corpus(Corpus("t", docs))
    assert [d.id for d in out] == ["orig", "other"]
    listed = {r: [e["id"] for e in v] for r, v in report["removed_documents"].items()}
    assert listed == {"exact_duplicate": ["copy"], "near_duplicate": ["near"], "too_short": ["short"],
                      "many_digits": ["numbers"], "few_letters": ["symbols"], "bad_characters": ["control"],
                      "too_few_words": ["few"]}
    assert report["removed_documents"]["exact_duplicate"][0]["of"] == "orig"
    near_entry = report["removed_documents"]["near_duplicate"][0]
    assert near_entry["of"] == "orig" and 0.85 <= near_entry["jaccard"] < 1
    assert report["documents_in"] == 9 and report["documents_kept"] == 2
    assert sum(report["removed"].values()) == 7


def test_unrelated_and_partially_overlapping_documents_are_kept():
    base = prose(200)
    half = " ".join(base.split()[:100]) + " " + prose(100)  # J ~ 1/3
    out, report = clean_corpus(Corpus("t", [Document("a", base), Document("b", half)]))
    assert len(out) == 2 and report["removed"]["near_duplicate"] == 0


def test_boilerplate_lines_are_removed_everywhere_and_only_them():
    footer = "Copyright 2024 Example Corp. All rights reserved."
    rare = "This sentence appears in exactly two documents only."
    docs = [Document(str(i), prose(50) + "\n" + footer + "\n" + (rare if i < 2 else prose(5)) + "\n" + prose(20))
            for i in range(6)]
    out, report = clean_corpus(Corpus("t", docs), CleanConfig(boilerplate_min_docs=3))
    assert len(out) == 6 and all(footer not in d.text for d in out)
    assert sum(rare in d.text for d in out) == 2
    assert report["boilerplate"]["lines_removed"] == 6
    assert report["boilerplate"]["top_lines"] == [{"line": footer, "removed": 6}]
    out2, _ = clean_corpus(Corpus("t", docs), CleanConfig(boilerplate_min_docs=0))
    assert all(footer in d.text for d in out2)


def test_cleaning_is_idempotent():
    base = prose(100)
    docs = [Document(str(i), t) for i, t in enumerate([base, base, prose(80), "x", prose(60) + "\nshared line of boilerplate text here"])]
    once, _ = clean_corpus(Corpus("t", docs))
    twice, report = clean_corpus(once)
    assert twice.documents == once.documents and report["documents_removed"] == 0


def test_cli_clean_writes_a_corpus_and_a_report(tmp_path):
    base = prose(120)
    (tmp_path / "c.jsonl").write_text("\n".join(json.dumps({"id": i, "text": t}) for i, t in
                                                enumerate([base, base, prose(90), "hi"])), encoding="utf-8")
    out = tmp_path / "clean.jsonl"
    r = subprocess.run([sys.executable, "-m", "lmkit", "data", "clean", "--corpus", str(tmp_path / "c.jsonl"),
                        "--out", str(out)], capture_output=True, text=True)
    assert r.returncode == 0, r.stderr
    report = json.loads((tmp_path / "clean.jsonl.report.json").read_text())
    assert report["removed"]["exact_duplicate"] == 1 and report["removed"]["too_short"] == 1
    assert [d.id for d in load_corpus(str(out))] == ["0", "2"]


@pytest.mark.parametrize("outputs, needle", [(["--out", "{c}"], "--out"),
                                             (["--out", "{d}/clean.jsonl", "--report", "{c}"], "--report"),
                                             (["--out", "{d}/clean.jsonl", "--report", "{d}/clean.jsonl"], "own name")])
def test_clean_refuses_outputs_that_would_replace_the_corpus(tmp_path, capsys, outputs, needle):
    corpus = tmp_path / "c.jsonl"
    corpus.write_text(json.dumps({"id": 0, "text": prose(60)}) + "\n" + json.dumps({"id": 1, "text": "hi"}) + "\n",
                      encoding="utf-8")
    raw = corpus.read_bytes()
    argv = ["data", "clean", "--corpus", str(corpus)] + [a.format(c=corpus, d=tmp_path) for a in outputs]
    assert main(argv) == 2
    err = capsys.readouterr().err.strip()
    assert err.startswith("lmkit: error: ") and "\n" not in err and needle in err, err
    assert corpus.read_bytes() == raw and not (tmp_path / "clean.jsonl").exists()


@pytest.mark.parametrize("flag", ["--min-alpha", "--max-digit", "--max-bad"])
def test_clean_refuses_a_character_share_outside_0_1(tmp_path, capsys, flag):
    corpus = tmp_path / "c.txt"
    corpus.write_text(prose(60), encoding="utf-8")
    assert main(["data", "clean", "--corpus", str(corpus), "--out", str(tmp_path / "o.jsonl"), flag, "1.5"]) == 2
    assert flag in capsys.readouterr().err and not (tmp_path / "o.jsonl").exists()
