"""BPE training by the incremental algorithm: pair counts over unique words (weighted by word count) are
built once; each merge rewrites only the words that hold the pair and applies the resulting count changes.
The next merge is the pair of highest count, ties to the smallest (left id, right id), as HF's BpeTrainer:
ids are the special tokens first, then the alphabet sorted by code point, then merges in order."""
from __future__ import annotations

import heapq


def _alphabet(word_counts: dict[str, int], initial_alphabet, limit_alphabet: int | None) -> list[str]:
    freq: dict[str, float] = {}
    for w, c in word_counts.items():
        for ch in w:
            freq[ch] = freq.get(ch, 0) + c
    for ch in initial_alphabet:
        freq[ch] = float("inf")
    kept = list(freq)
    if limit_alphabet is not None and len(kept) > limit_alphabet:
        kept.sort(key=lambda ch: freq[ch])
        kept = kept[len(kept) - limit_alphabet:]
    return sorted(kept)


def train_bpe(word_counts: dict[str, int], vocab_size: int, special_tokens: list[str] = (), initial_alphabet=(),
              min_frequency: int = 0, limit_alphabet: int | None = None, continuing_subword_prefix: str | None = None,
              end_of_word_suffix: str | None = None, max_token_length: int | None = None,
              progress=None) -> tuple[dict[str, int], list[tuple[str, str]]]:
    """Returns (vocab, merges). `progress(n)` is called with the number of merges done since the last call.

    max_token_length, as `tokenizers`: a merge is counted as a candidate only while the two symbols together
    span fewer than max_token_length characters of the word (prefix and suffix not counted); the pairs of
    single characters the words start with are always candidates."""
    vocab: dict[str, int] = {}
    id_to_word: list[str] = []

    def add(token: str) -> int:
        tid = vocab.get(token)
        if tid is None:
            tid = vocab[token] = len(id_to_word)
            id_to_word.append(token)
        return tid

    for t in special_tokens:
        add(t)
    for ch in _alphabet(word_counts, initial_alphabet, limit_alphabet):
        add(ch)

    prefix, suffix = continuing_subword_prefix, end_of_word_suffix
    words: list[list[int]] = []
    counts: list[int] = []
    for w, c in word_counts.items():
        ids, last = [], len(w) - 1
        for i, ch in enumerate(w):
            if ch not in vocab:
                continue  # dropped by limit_alphabet
            s = ch
            if i and prefix:
                s = prefix + s
            if i == last and suffix:
                s = s + suffix
            ids.append(add(s))
        words.append(ids)
        counts.append(c)

    pair_counts: dict[tuple[int, int], int] = {}
    where: dict[tuple[int, int], set[int]] = {}
    for wi, ids in enumerate(words):
        c = counts[wi]
        for pair in zip(ids, ids[1:]):
            pair_counts[pair] = pair_counts.get(pair, 0) + c
            s = where.get(pair)
            if s is None:
                where[pair] = {wi}
            else:
                s.add(wi)
    span = [1] * len(id_to_word)  # characters of the word each symbol covers (for max_token_length)
    limit = max_token_length if max_token_length is not None else -1
    heap = [(-c, a, b) for (a, b), c in pair_counts.items() if c > 0]
    heapq.heapify(heap)

    merges: list[tuple[int, int]] = []
    plen = len(prefix) if prefix else 0
    done = 0
    while len(vocab) < vocab_size and heap:
        neg, a, b = heapq.heappop(heap)
        pair = (a, b)
        cur = pair_counts.get(pair, 0)
        if -neg != cur:
            if cur > 0:
                heapq.heappush(heap, (-cur, a, b))
            continue
        if cur < 1 or cur < min_frequency:
            break
        part_b = id_to_word[b]
        if plen and part_b.startswith(prefix):
            part_b = part_b[plen:]
        new = add(id_to_word[a] + part_b)
        merges.append(pair)
        if limit >= 0:
            if new == len(span):
                span.append(span[a] + span[b])
            s_new = span[new]

        delta: dict[tuple[int, int], int] = {}
        grown: dict[tuple[int, int], list[int]] = {}
        for wi in where.pop(pair, ()):
            w = words[wi]
            n = len(w)
            i = 0
            c = counts[wi]
            while True:
                try:
                    i = w.index(a, i, n - 1)
                except ValueError:
                    break
                if w[i + 1] != b:
                    i += 1
                    continue
                if i:
                    p = w[i - 1]
                    k = (p, a)
                    delta[k] = delta.get(k, 0) - c
                    if limit < 0 or span[p] + s_new < limit:
                        k = (p, new)
                        delta[k] = delta.get(k, 0) + c
                        grown.setdefault(k, []).append(wi)
                w[i:i + 2] = (new,)
                n -= 1
                if i < n - 1:
                    q = w[i + 1]
                    k = (b, q)
                    delta[k] = delta.get(k, 0) - c
                    if limit < 0 or span[q] + s_new < limit:
                        k = (new, q)
                        delta[k] = delta.get(k, 0) + c
                        grown.setdefault(k, []).append(wi)
                i += 1
        pair_counts[pair] = 0
        for k, d in delta.items():
            total = pair_counts.get(k, 0) + d
            pair_counts[k] = total
            if k in grown:
                s = where.get(k)
                if s is None:
                    where[k] = set(grown[k])
                else:
                    s.update(grown[k])
                if total > 0:
                    heapq.heappush(heap, (-total, k[0], k[1]))
        done += 1
        if progress is not None and done % 64 == 0:
            progress(64)
    if progress is not None and done % 64:
        progress(done % 64)
    return vocab, [(id_to_word[a], id_to_word[b]) for a, b in merges]
