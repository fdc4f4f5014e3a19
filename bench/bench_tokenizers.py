"""Tokenizer speed, side by side: lmkit vs Hugging Face `tokenizers` vs tiktoken on 4 MB of CPython docs + code.

    python bench/bench_tokenizers.py [--mb 4] [--vocab-size 8192]

Byte-level BPE: training time, and encode_batch throughput with ids checked identical; WordPiece likewise.
Prints a markdown table. Timings are wall clock on this machine, one run each (no repetition).
"""
from __future__ import annotations

import argparse
import json
import os
import sys
import sysconfig
import time
from pathlib import Path

import machine  # bench/machine.py (the script's folder is on sys.path)


def corpus(limit_bytes: int) -> list[str]:
    """pydoc topics (the reference manual's topics), then standard-library modules in name order."""
    import pydoc_data.topics

    texts = [v for _, v in sorted(pydoc_data.topics.topics.items())]
    n = sum(len(t.encode()) for t in texts)
    for p in sorted(Path(sysconfig.get_paths()["stdlib"]).glob("*.py")):
        if n >= limit_bytes:
            break
        s = p.read_text(encoding="utf-8", errors="replace")
        texts.append(s)
        n += len(s.encode())
    return texts


def timed(fn):
    start = time.perf_counter()
    out = fn()
    return out, time.perf_counter() - start


def hf_tokenizer(kind: str, vocab_size: int, special: list[str]):
    from tokenizers import Tokenizer, decoders, models, normalizers, pre_tokenizers, trainers

    if kind == "bpe":
        tok = Tokenizer(models.BPE())
        tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
        tok.decoder = decoders.ByteLevel()
        trainer = trainers.BpeTrainer(vocab_size=vocab_size, special_tokens=special, show_progress=False,
                                      initial_alphabet=pre_tokenizers.ByteLevel.alphabet())
    elif kind == "unigram":
        tok = Tokenizer(models.Unigram())
        tok.normalizer = normalizers.NFKC()
        tok.pre_tokenizer = pre_tokenizers.Metaspace()
        tok.decoder = decoders.Metaspace()
        trainer = trainers.UnigramTrainer(vocab_size=vocab_size, special_tokens=special, unk_token="<unk>",
                                          show_progress=False)
    else:
        tok = Tokenizer(models.WordPiece(unk_token="[UNK]"))
        tok.normalizer = normalizers.BertNormalizer()
        tok.pre_tokenizer = pre_tokenizers.BertPreTokenizer()
        tok.decoder = decoders.WordPiece()
        trainer = trainers.WordPieceTrainer(vocab_size=vocab_size, special_tokens=special, show_progress=False)
    return tok, trainer


def _tied(tok, a, b) -> bool:
    score = tok.model.score
    sa, sb = score([tok.id_to_token(i) for i in a]), score([tok.id_to_token(i) for i in b])
    return abs(sa - sb) <= 1e-9 * max(1.0, abs(sa))


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--mb", type=float, default=4.0)
    ap.add_argument("--vocab-size", type=int, default=8192)
    ap.add_argument("--kinds", nargs="+", default=["bpe", "wordpiece", "unigram"])
    ap.add_argument("--lines", action="store_true",
                    help="encode the corpus as its non-blank lines (many short texts, as datasets.map feeds them)")
    args = ap.parse_args(argv)
    import tiktoken
    import tokenizers

    from lmkit.tokenizers import train_tokenizer

    texts = corpus(int(args.mb * 1e6))
    if args.lines:
        texts = [line for t in texts for line in t.splitlines() if line.strip()]
    mb = sum(len(t.encode()) for t in texts) / 1e6
    rows = []
    kinds = (("bpe", ["<|endoftext|>", "<|pad|>"]), ("wordpiece", ["[PAD]", "[UNK]", "[CLS]", "[SEP]", "[MASK]"]),
             ("unigram", ["<pad>", "</s>", "<unk>"]))
    for kind, special in kinds:
        if kind not in args.kinds:
            continue
        hf, trainer = hf_tokenizer(kind, args.vocab_size, special)
        _, t_hf = timed(lambda: hf.train_from_iterator(texts, trainer))
        ours, t_ours = timed(lambda: train_tokenizer(texts, kind, args.vocab_size, special_tokens=special))
        same_merges = (kind == "bpe" and [list(m) for m in ours.model.merges] ==
                       [list(m) for m in json.loads(hf.to_str())["model"]["merges"]])
        note = ", same merges" if same_merges else ""
        if kind == "unigram":  # the share of tokenizers' pieces lmkit learned too
            theirs = {p for p, _ in json.loads(hf.to_str())["model"]["vocab"]}
            note = f", {sum(p in theirs for p, _ in ours.model.pieces) / len(theirs):.2%} of its pieces"
        rows.append((f"{kind}: train, vocab {args.vocab_size}", "lmkit", f"{t_ours:.2f} s",
                     f"{t_ours / t_hf:.2f}x tokenizers" + note))
        rows.append((f"{kind}: train, vocab {args.vocab_size}", "tokenizers", f"{t_hf:.2f} s", "1.00x"))

        hf = tokenizers.Tokenizer.from_str(ours.to_str())  # the same vocabulary, so ids must agree
        hf_ids, e_hf = timed(lambda: [e.ids for e in hf.encode_batch(texts, add_special_tokens=False)])

        def same(ids):  # for Unigram, a row may differ where Viterbi ties: both paths must score the same
            return ids == hf_ids or (kind == "unigram" and all(a == b or _tied(ours, a, b) for a, b in zip(ids, hf_ids)))
        ours_ids, e_ours = timed(lambda: ours.encode_batch(texts, add_special_tokens=False))
        name = "lmkit encode_batch" + (" (tiktoken engine)" if ours.engine() is not None else " (2 processes)")
        rows.append((f"{kind}: encode", name, f"{mb / e_ours:.1f} MB/s",
                     f"{e_hf / e_ours:.2f}x tokenizers, ids identical: {same(ours_ids)}"))
        os.environ["LMKIT_NO_TIKTOKEN"] = "1"
        ours._reset()
        cpu = time.process_time()
        py_ids, e_py = timed(lambda: [ours.encode(t, add_special_tokens=False) for t in texts])
        cpu = time.process_time() - cpu
        rows.append((f"{kind}: encode", "lmkit pure Python, 1 process", f"{mb / e_py:.1f} MB/s ({mb / cpu:.1f} MB/s CPU time)",
                     f"{e_hf / e_py:.2f}x tokenizers, ids identical: {same(py_ids)}"))
        if kind != "bpe":
            ours._reset()
            par_ids, e_par = timed(lambda: ours.encode_batch(texts, add_special_tokens=False, num_workers=2))
            rows[-2] = (f"{kind}: encode", "lmkit encode_batch, 2 processes", f"{mb / e_par:.1f} MB/s",
                        f"{e_hf / e_par:.2f}x tokenizers, ids identical: {same(par_ids)}")
        del os.environ["LMKIT_NO_TIKTOKEN"]
        ours._reset()
        rows.append((f"{kind}: encode", "tokenizers encode_batch", f"{mb / e_hf:.1f} MB/s", "1.00x"))
        if kind == "bpe":
            enc = ours.engine().encoding
            tk_ids, e_tk = timed(lambda: enc.encode_ordinary_batch(texts))
            rows.append((f"{kind}: encode", "tiktoken encode_ordinary_batch (same ranks)", f"{mb / e_tk:.1f} MB/s",
                         f"{e_hf / e_tk:.2f}x tokenizers, ids identical: {tk_ids == hf_ids}"))

    print(f"\nCorpus: {mb:.2f} MB ({len(texts)} texts: pydoc topics + stdlib modules), {os.cpu_count()} CPUs, "
          f"Python {sys.version.split()[0]}, tokenizers {tokenizers.__version__}, tiktoken {tiktoken.__version__}\n")
    print(machine.describe([]))
    print("| task | implementation | result | vs tokenizers |")
    print("| --- | --- | --- | --- |")
    for r in rows:
        print("| " + " | ".join(r) + " |")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
