"""Unigram training (Kudo 2018, SentencePiece): seed with frequent substrings, then repeat
  EM: E-step expected piece counts by forward-backward over each word's lattice,
      M-step log p(x) = digamma(count(x)) - digamma(sum counts) (the Bayesian update SentencePiece uses),
  prune: drop the pieces whose removal raises the corpus loss least, keeping `shrinking_factor` of them,
until the vocabulary is small enough. Every character seen stays a piece, so any training word is covered."""
from __future__ import annotations

import math
from collections import Counter

from lmkit.errors import TokenizerError

NEG_INF = float("-inf")


def digamma(x: float) -> float:
    """psi(x) by the recurrence psi(x) = psi(x + 1) - 1/x up to x >= 10, then the asymptotic series."""
    r = 0.0
    while x < 10.0:
        r -= 1.0 / x
        x += 1.0
    f = 1.0 / (x * x)
    return r + math.log(x) - 0.5 / x - f * (1.0 / 12 - f * (1.0 / 120 - f * (1.0 / 252 - f * (1.0 / 240 - f / 132))))


def _logaddexp(a: float, b: float) -> float:
    if a == NEG_INF:
        return b
    if b == NEG_INF:
        return a
    if a < b:
        a, b = b, a
    return a + math.log1p(math.exp(b - a))


def seed_pieces(word_counts: dict[str, int], chars: set[str], max_len: int, seed_size: int) -> dict[str, float]:
    """Substrings of 2..max_len characters seen at least twice, scored by frequency * length, plus all chars."""
    sub: Counter = Counter()
    for w, c in word_counts.items():
        n = len(w)
        for i in range(n):
            for j in range(i + 2, min(n, i + max_len) + 1):
                sub[w[i:j]] += c
    cands = sorted(((f * len(s), s) for s, f in sub.items() if f > 1), reverse=True)[:seed_size]
    freq = {s: float(sub[s]) for _, s in cands}
    char_freq: Counter = Counter()
    for w, c in word_counts.items():
        for ch in w:
            char_freq[ch] += c
    for ch in sorted(chars):
        freq[ch] = float(char_freq[ch] or 1)
    total = math.log(sum(freq.values()))
    return {s: math.log(f) - total for s, f in freq.items()}


def _lattices(words: list[tuple[str, int]], scores: dict[str, float], max_len: int) -> list:
    """Per word: (n, count, edges [(start, end, piece)] sorted by start). Pieces only ever leave the
    vocabulary, so edges are found once and filtered afterwards."""
    out = []
    canon = {p: p for p in scores}  # one string object per piece, shared by every edge
    prefixes = {p[:k] for p in scores for k in range(1, len(p) + 1)}
    get = canon.get
    for w, c in words:
        n = len(w)
        edges = []
        for i in range(n):
            for j in range(i + 1, min(n, i + max_len) + 1):
                sub = w[i:j]
                if sub not in prefixes:
                    break
                p = get(sub)
                if p is not None:
                    edges.append((i, j, p))
        out.append((n, c, edges))
    return out


def _filter(lattices: list, scores: dict[str, float]) -> list:
    return [(n, c, [e for e in edges if e[2] in scores]) for n, c, edges in lattices]


def _estep_log(scores, n, edges):
    alpha = [NEG_INF] * (n + 1)
    alpha[0] = 0.0
    for i, j, p in edges:  # sorted by start: alpha[i] is final when read
        if alpha[i] != NEG_INF:
            alpha[j] = _logaddexp(alpha[j], alpha[i] + scores[p])
    beta = [NEG_INF] * (n + 1)
    beta[n] = 0.0
    for i, j, p in reversed(edges):
        if beta[j] != NEG_INF:
            beta[i] = _logaddexp(beta[i], beta[j] + scores[p])
    z = alpha[n]
    return z, [(p, math.exp(alpha[i] + scores[p] + beta[j] - z)) for i, j, p in edges] if z != NEG_INF else []


def _estep(scores: dict[str, float], lattices: list):
    """Expected count of each piece (forward-backward: alpha(i) p(x) beta(j) / Z), and the corpus NLL."""
    expected: dict[str, float] = dict.fromkeys(scores, 0.0)
    prob = {p: math.exp(s) for p, s in scores.items()}
    nll = 0.0
    for n, c, edges in lattices:
        alpha = [0.0] * (n + 1)
        alpha[0] = 1.0
        for i, j, p in edges:
            alpha[j] += alpha[i] * prob[p]
        z = alpha[n]
        if z < 1e-250:  # long word: probabilities underflow, redo it in log space
            lz, posts = _estep_log(scores, n, edges)
            if lz != NEG_INF:
                nll -= c * lz
                for p, q in posts:
                    expected[p] += c * q
            continue
        beta = [0.0] * (n + 1)
        beta[n] = 1.0
        for i, j, p in reversed(edges):
            beta[i] += beta[j] * prob[p]
        nll -= c * math.log(z)
        k = c / z
        for i, j, p in edges:
            expected[p] += k * alpha[i] * prob[p] * beta[j]
    return expected, nll


def _mstep(expected: dict[str, float], keep: set[str]) -> dict[str, float]:
    kept = {p: f for p, f in expected.items() if f >= 0.5 or p in keep}
    logsum = digamma(sum(kept.values()) + 1e-12)
    return {p: digamma(max(f, 1e-6)) - logsum for p, f in kept.items()}


def _viterbi(scores: dict[str, float], w: str, max_len: int, skip: str | None = None) -> list[str]:
    n = len(w)
    best = [0.0] + [NEG_INF] * n
    back = [0] * (n + 1)
    for i in range(n):
        if best[i] == NEG_INF:
            continue
        for j in range(i + 1, min(n, i + max_len) + 1):
            p = w[i:j]
            s = scores.get(p)
            if s is None or p == skip:
                continue
            if best[i] + s > best[j]:
                best[j], back[j] = best[i] + s, i
    if best[n] == NEG_INF:
        return []
    out, j = [], n
    while j > 0:
        out.append(w[back[j]:j])
        j = back[j]
    return out[::-1]


def _best_path(scores: dict[str, float], n: int, edges) -> list[str]:
    best = [0.0] + [NEG_INF] * n
    back: list = [None] * (n + 1)
    for i, j, p in edges:
        b = best[i]
        if b != NEG_INF and b + scores[p] > best[j]:
            best[j], back[j] = b + scores[p], (i, p)
    out, j = [], n
    while j > 0 and back[j] is not None:
        j, p = back[j]
        out.append(p)
    return out


def _prune(scores: dict[str, float], lattices, max_len: int, target: int, keep: set[str]) -> dict[str, float]:
    """Keep the `target` pieces whose removal would cost the most likelihood (SentencePiece's pruning)."""
    freq: Counter = Counter()
    for n, c, edges in lattices:
        for p in _best_path(scores, n, edges):
            freq[p] += c
    vsum = sum(freq.values())
    loss: dict[str, float] = {}
    for p in scores:
        if p in keep:
            continue
        f = freq.get(p, 0)
        if f == 0:
            loss[p] = NEG_INF  # unused by any best path: first to go
            continue
        alts = _viterbi(scores, p, max_len, skip=p) if len(p) > 1 else []
        if not alts:
            loss[p] = float("inf")
            continue
        logsum_alt = math.log(vsum + f * (len(alts) - 1))
        logprob_alt = sum(math.log(freq.get(a, 0) + f) - logsum_alt for a in alts)
        logprob_sp = math.log(f) - math.log(vsum)
        loss[p] = f / vsum * (logprob_sp - logprob_alt)
    ranked = sorted(loss, key=lambda p: loss[p], reverse=True)
    kept = set(ranked[:max(0, target - len(keep))]) | keep
    return {p: s for p, s in scores.items() if p in kept}


def train_unigram(word_counts: dict[str, int], vocab_size: int, special_tokens: list[str] = (),
                  unk_token: str | None = None, max_piece_length: int = 16, shrinking_factor: float = 0.75,
                  n_sub_iterations: int = 2, seed_size: int | None = None, progress=None) -> tuple[list, int | None]:
    """Returns (pieces [(piece, log p)], unk_id): special tokens first (score 0), then pieces by score.
    seed_size: substrings kept as the initial vocabulary (default 10 x vocab_size, at most a million)."""
    words = sorted(word_counts.items())
    chars = {ch for w in word_counts for ch in w}
    budget = vocab_size - len(special_tokens)
    if len(chars) > budget:  # a Unigram vocabulary holds every character (HF refuses too)
        raise TokenizerError(f"vocab_size {vocab_size} cannot hold the corpus's {len(chars)} distinct characters and "
                             f"{len(special_tokens)} special tokens; use vocab_size >= {len(chars) + len(special_tokens)}")
    scores = seed_pieces(word_counts, chars, max_piece_length, seed_size or min(1_000_000, 10 * max(budget, 100)))
    desired = max(len(chars), int(budget * 1.1))
    lattices = _lattices(words, scores, max_piece_length)
    while True:
        for _ in range(n_sub_iterations):
            expected, _ = _estep(scores, lattices)
            scores = _mstep(expected, chars)
            lattices = _filter(lattices, scores)
        if progress is not None:
            progress(len(scores))
        if len(scores) <= desired:
            break
        target = max(desired, int(len(scores) * shrinking_factor))
        pruned = _prune(scores, lattices, max_piece_length, target, chars)
        if len(pruned) == len(scores):
            break
        scores = pruned
        lattices = _filter(lattices, scores)
    # characters EM dropped (expected count < 0.5; kept only because every character must stay) carry a
    # meaningless digamma(~0) score near -1e6: score them as HF's UnigramTrainer.finalize does, the lowest
    # score of the other pieces plus 1e-4 per character already so placed (most frequent first)
    dropped = {ch for ch in chars if expected.get(ch, 0.0) < 0.5}
    if dropped:
        floor = min((s for p, s in scores.items() if p not in dropped), default=0.0)
        char_freq: Counter = Counter()
        for w, c in word_counts.items():
            for ch in w:
                char_freq[ch] += c
        for k, ch in enumerate(sorted(dropped, key=lambda ch: (-char_freq[ch], ch))):
            scores[ch] = floor + 1e-4 * k
    # final cut to the budget: every character, then the most probable pieces
    rest = sorted((p for p in scores if p not in chars), key=lambda p: (-scores[p], p))
    final = sorted(chars, key=lambda p: (-scores[p], p))
    final = sorted(final + rest[:max(0, budget - len(final))], key=lambda p: (-scores[p], p))
    # 15 significant digits: what JSON readers (serde_json in HF included) parse back to the same double
    pieces = [(t, 0.0) for t in special_tokens] + [(p, float(f"{scores[p]:.15g}")) for p in final
                                                   if p not in special_tokens]
    unk_id = special_tokens.index(unk_token) if unk_token in special_tokens else None
    return pieces, unk_id
