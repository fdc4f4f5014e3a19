"""Unigram training (Kudo 2018), step by step as Hugging Face `tokenizers`' UnigramTrainer does it:

1. seeds: every character, scored by its count in the corpus, then the repeated substrings of the distinct
   words (suffix-tree nodes of 2..max_piece_length characters within a word), scored occurrences * length
   over the distinct words, highest first; `seed_size` pieces in all; log p = log(score / sum of scores).
2. EM, `n_sub_iterations` times: E-step, expected piece counts by forward-backward over each word's lattice;
   M-step, drop the pieces expected < 0.5 and set log p(x) = digamma(count(x)) - digamma(sum of counts).
3. while more than 1.1 vocab_size pieces remain, prune. With f(x) the count of x on the words' Viterbi
   paths, F = sum f, N = sum of word counts, V = number of pieces, and x1..xk the best segmentation of x
   without x itself:  loss(x) = f(x)/N (log f(x)/F - sum_i log (f(x_i) + f(x)) / (F + f(x)(V - 1))).
   (k - 1 would be the mass moved; `tokenizers` keeps older SentencePiece's V - 1.) Pieces without alternative stay,
   unused ones go, then the highest losses fill up to max(1.1 vocab_size, shrinking_factor V); then 2. again.
4. finalize: every required character (the corpus's and `initial_alphabet`), one EM dropped scored at the
   lowest score + 1e-4 per such character; then the pieces in model order up to vocab_size; sorted by score
   (a stable sort); special tokens first, the unk token at id 0 when it is not one of them.
A character with no piece is an unk node scored min score - 10 in the lattice, as in the encoder.

`tokenizers` visits its words in hash order, so its sums (and the ties they break) vary from run to run in
the last bits; here words are sorted. That, which of two equal-score characters comes first (and so which
dropped character gets which 1e-4 step), and a vocabulary never larger than vocab_size (`tokenizers` adds
every piece when the characters fill the budget exactly) are the only intended differences.
"""
from __future__ import annotations

import numpy as np

from lmkit.errors import TokenizerError
from lmkit.tokenizers.trainers.lattice import WordLattices, _ranges
from lmkit.tokenizers.trainers.suffix import repeats

UNK_PENALTY = 10.0


def digamma(x):
    """psi(x) as `tokenizers` computes it: psi(x) = psi(x + 1) - 1/x up to x >= 7, then
    ln(y) + 1/(24 y^2) - 7/(960 y^4) + 31/(8064 y^6) - 127/(30720 y^8) with y = x - 1/2."""
    x = np.array(x, dtype=np.float64)
    r = np.zeros_like(x)
    small = x < 7.0
    while small.any():
        r[small] -= 1.0 / x[small]
        x[small] += 1.0
        small = x < 7.0
    x -= 0.5
    xx2 = (1.0 / x) ** 2
    xx4 = xx2 * xx2
    r += (np.log(x) + (1.0 / 24.0) * xx2 - 7.0 / 960.0 * xx4 + (31.0 / 8064.0) * xx4 * xx2
          - (127.0 / 30720.0) * xx4 * xx4)
    return float(r) if r.ndim == 0 else r


class _Corpus:
    """The distinct words end to end, each followed by NUL (the layout the suffix array needs)."""

    def __init__(self, words: list[str], counts: list[int]):
        self.words = words
        self.text = "\0".join(words) + "\0"
        self.codes = np.frombuffer(self.text.encode("utf-32-le"), dtype=np.uint32).astype(np.int64)
        lens = np.array([len(w) for w in words], dtype=np.int64)
        self.start = np.concatenate(([0], np.cumsum(lens + 1)[:-1]))
        self.end = self.start + lens
        self.count = np.array(counts, dtype=np.float64)
        self.inside = _ranges(self.start, self.end)  # every position of every word
        self.weight = np.repeat(self.count, lens)  # the count of the word each position belongs to


def _seeds(corpus: _Corpus, max_piece_length: int, seed_size: int):
    """(pieces, raw scores, occ, edge pos, len, pid). Pieces: characters by count (then code point, both
    descending), then substrings by occurrences * length (then the string, both descending); their ids count
    from 1 (0 is unk). occ: where one occurrence of each substring starts. Edges: every occurrence of a seed."""
    codes, text = corpus.codes, corpus.text
    char_codes = codes[corpus.inside]
    uniq, inv = np.unique(char_codes, return_inverse=True)
    char_count = np.bincount(inv.reshape(-1), weights=corpus.weight, minlength=len(uniq))
    chars = sorted(((int(round(c)), chr(int(u))) for u, c in zip(uniq, char_count) if u != 0), reverse=True)
    pieces = [ch for _, ch in chars]
    raw = [float(c) for c, _ in chars]

    sa, nodes = repeats(codes, max_piece_length)
    zeros = np.flatnonzero(codes == 0)
    room = zeros[np.searchsorted(zeros, np.arange(len(codes)))] - np.arange(len(codes))  # chars before a NUL
    cand = []  # (score, string, lo, hi, d)
    for d, lo, hi in nodes:
        ok = room[sa[lo]] >= d
        for a, b, p in zip(lo[ok].tolist(), hi[ok].tolist(), sa[lo[ok]].tolist()):
            cand.append(((b - a) * d, text[p:p + d], a, b, d))
    cand.sort(key=lambda t: (t[0], t[1]), reverse=True)
    if cand:
        cand = cand[:max(1, seed_size - len(pieces))]  # `tokenizers` pushes one substring before it checks

    # edges: one per character of every word (unk, id 0, where no character piece exists: NUL) ...
    char_id = np.zeros(len(uniq), dtype=np.int64)
    where = {ch: i + 1 for i, ch in enumerate(pieces)}
    for k, u in enumerate(uniq.tolist()):
        char_id[k] = where.get(chr(u), 0)
    pos = [corpus.inside]
    length = [np.ones(len(corpus.inside), dtype=np.int32)]
    pid = [char_id[inv.reshape(-1)].astype(np.int32)]
    # ... and one per occurrence of every seed substring
    first = len(pieces) + 1
    occ = np.zeros(first + len(cand), dtype=np.int64)
    if cand:
        lo = np.array([c[2] for c in cand], dtype=np.int64)
        hi = np.array([c[3] for c in cand], dtype=np.int64)
        d = np.array([c[4] for c in cand], dtype=np.int32)
        ids = np.arange(first, first + len(cand), dtype=np.int32)
        pos.append(sa[_ranges(lo, hi)])
        length.append(np.repeat(d, hi - lo))
        pid.append(np.repeat(ids, hi - lo))
        occ[first:] = sa[lo]
        pieces += [c[1] for c in cand]
        raw += [float(c[0]) for c in cand]
    return pieces, np.array(raw), occ, np.concatenate(pos), np.concatenate(length), np.concatenate(pid)


class _Model:
    """The current pieces: `ids` in model order (after the implicit unk at 0) and log p per global id."""

    def __init__(self, ids: np.ndarray, logp: np.ndarray):
        self.ids, self.logp = ids, logp
        self.alive = np.zeros(len(logp), dtype=bool)
        self.alive[ids] = True

    def edge_scores(self, pid: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
        """(score, piece id) of lattice edges: a character that is no piece is unk, scored min - 10."""
        dead = ~self.alive[pid]
        score = self.logp[pid]
        score[dead] = self.logp[self.ids].min() - UNK_PENALTY
        return score, np.where(dead, 0, pid)


def _em_step(lat: WordLattices, model: _Model) -> _Model:
    score, pid = model.edge_scores(lat.pid)
    expected = np.bincount(pid, weights=lat.marginals(score), minlength=len(model.logp))
    e = expected[model.ids]
    keep = e >= 0.5
    ids, freq = model.ids[keep], e[keep]
    logp = np.full(len(model.logp), np.nan)
    if len(freq):
        logp[ids] = digamma(freq) - digamma(np.cumsum(freq)[-1])  # a running sum in model order, as tokenizers
    return _Model(ids, logp)


def _prune(lat: WordLattices, model: _Model, length: np.ndarray, occ: np.ndarray, pruned_size: int) -> _Model:
    score, pid = model.edge_scores(lat.pid)
    edges, words = lat.viterbi(score)
    freq = np.bincount(pid[edges], weights=lat.count[words], minlength=len(model.logp))
    total, n_words, n_pieces = freq.sum(), lat.count.sum(), len(model.ids) + 1
    ids = model.ids
    multi = length[ids] > 1
    mids = ids[multi]
    alt_score, alt_edges, alt_of = lat.second_best(occ[mids], length[mids], score)
    f = freq[mids]
    with np.errstate(divide="ignore", invalid="ignore"):
        logsum_alt = np.log(total + f * (n_pieces - 1))
        terms = np.log(freq[pid[alt_edges]] + f[alt_of]) - logsum_alt[alt_of]
        logprob_alt = np.bincount(alt_of, weights=terms, minlength=len(mids))
        loss = f / n_words * (np.log(f) - np.log(total) - logprob_alt)
    own_best = model.logp[mids] >= alt_score  # the piece is its own best segmentation: it has alternatives
    status = np.ones(len(ids), dtype=np.int8)  # 1 keep, 0 drop, 2 candidate
    st = np.where(f == 0, 0, np.where(own_best, 2, 1))
    status[multi] = st
    kept = ids[status == 1]
    cand_pos = np.flatnonzero(status == 2)
    cand_loss = np.zeros(len(ids))
    cand_loss[np.flatnonzero(multi)] = loss
    order = cand_pos[np.argsort(-cand_loss[cand_pos], kind="stable")]
    room = pruned_size - 1 - len(kept)
    if room >= 0:  # `tokenizers` stops when the count reaches pruned_size exactly, so past it keeps them all
        order = order[:room]
    new_ids = np.concatenate((kept, ids[order]))
    logp = np.full(len(model.logp), np.nan)
    logp[new_ids] = model.logp[new_ids]
    return _Model(new_ids, logp)


def train_unigram(word_counts: dict[str, int], vocab_size: int, special_tokens: list[str] = (),
                  unk_token: str | None = None, max_piece_length: int = 16, shrinking_factor: float = 0.75,
                  n_sub_iterations: int = 2, seed_size: int = 1_000_000, initial_alphabet=(),
                  progress=None) -> tuple[list, int | None]:
    """Returns (pieces [(piece, log p)], unk_id): special tokens first (score 0), then pieces by score.
    Defaults are `tokenizers`' UnigramTrainer's; vocab_size counts the special tokens."""
    if not 0.0 < shrinking_factor < 1.0:
        raise TokenizerError(f"shrinking_factor must lie strictly between 0 and 1, not {shrinking_factor}")
    if max_piece_length < 1 or n_sub_iterations < 1 or seed_size < 1:
        raise TokenizerError("max_piece_length, n_sub_iterations and seed_size must be at least 1, not "
                             f"{max_piece_length}, {n_sub_iterations}, {seed_size}")
    special_tokens = list(special_tokens)
    add_unk = unk_token is not None and unk_token not in special_tokens
    if add_unk:
        special_tokens.insert(0, unk_token)  # where `tokenizers` puts an unk token it was not given
    words = sorted(w for w, c in word_counts.items() if w and c > 0)
    required = {ch for w in words for ch in w} | {a[0] for a in initial_alphabet if a}  # HF keeps the first char
    budget = vocab_size - len(special_tokens)
    if len(required) > budget:  # a Unigram vocabulary holds every character (HF refuses too)
        raise TokenizerError(f"vocab_size {vocab_size} cannot hold the corpus's {len(required)} distinct characters "
                             f"and {len(special_tokens)} special tokens; use vocab_size >= "
                             f"{len(required) + len(special_tokens)}")
    pieces: list[str] = []
    model = None
    if words:
        corpus = _Corpus(words, [word_counts[w] for w in words])
        pieces, raw, occ, pos, length, pid = _seeds(corpus, max_piece_length, seed_size)
        logp = np.concatenate(([np.nan], np.log(raw) - np.log(raw.sum())))  # to_log_prob; 0 is unk
        model = _Model(np.arange(1, len(logp)), logp)
        piece_len = np.array([0] + [len(p) for p in pieces], dtype=np.int64)
        lat = WordLattices(corpus.start, corpus.end, corpus.count, len(corpus.codes), pos, length, pid)
        del pos, length, pid
        desired = vocab_size * 11 // 10
        while True:
            for _ in range(n_sub_iterations):
                model = _em_step(lat, model)
                lat.keep(model.alive[lat.pid] | (lat.len == 1))
            if progress is not None:
                progress(len(model.ids) + 1)
            if len(model.ids) + 1 <= desired:
                break
            model = _prune(lat, model, piece_len, occ, max(desired, int((len(model.ids) + 1) * shrinking_factor)))
            lat.keep(model.alive[lat.pid] | (lat.len == 1))
    # finalize
    final: list[tuple[str, float]] = []
    inserted = set()
    gid = {p: i + 1 for i, p in enumerate(pieces)}
    floor = float(model.logp[model.ids].min()) if model is not None and len(model.ids) else 0.0
    penalty = 0.0
    for ch in sorted(required):  # `tokenizers` goes in hash order: ties between characters may come out swapped
        g = gid.get(ch)
        if g is not None and model.alive[g]:
            final.append((ch, float(model.logp[g])))
        else:
            final.append((ch, floor + penalty))
            penalty += 0.0001
        inserted.add(ch)
    if model is not None:
        for g in model.ids.tolist():
            if len(final) >= budget:  # `tokenizers` tests == after a push: a full alphabet there gets every piece
                break
            p = pieces[g - 1]
            if p not in inserted:
                inserted.add(p)
                final.append((p, float(model.logp[g])))
    final.sort(key=lambda t: -t[1])
    # 15 significant digits: what JSON readers (serde_json in HF included) parse back to the same double
    out = [(t, 0.0) for t in special_tokens] + [(p, float(f"{s:.15g}")) for p, s in final if p not in special_tokens]
    unk_id = special_tokens.index(unk_token) if unk_token is not None else None
    return out, unk_id
