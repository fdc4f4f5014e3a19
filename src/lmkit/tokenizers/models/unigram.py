"""Unigram language model (Kudo 2018): a word's segmentation is the Viterbi path
argmax_x sum_i log p(x_i) over all segmentations x into vocabulary pieces.

Characters no piece covers get the unk piece with score min(log p) - 10, and runs of unk are fused,
as SentencePiece and Hugging Face do; `tokenize` returns such a run as its own text (HF's token string), with
id unk_id. Ties keep the path found first (the earliest start), as HF does.
"""
from __future__ import annotations

from lmkit.errors import TokenizerError
from lmkit.tokenizers.models.base import Model

UNK_PENALTY = 10.0


class Unigram(Model):
    type_name = "Unigram"

    def __init__(self, pieces: list[tuple[str, float]], unk_id: int | None = None, byte_fallback: bool = False):
        # a piece listed twice (HF's trainer learns "[CLS]" again when the text holds it) has, as in HF, the id
        # and score of its last entry; each id still names its own entry
        super().__init__({p: i for i, (p, _) in enumerate(pieces)})
        self.pieces = [(p, float(s)) for p, s in pieces]
        self.scores = dict(self.pieces)
        self.unk_id, self.byte_fallback = unk_id, byte_fallback
        self.min_score = min((s for _, s in self.pieces), default=0.0)
        self.max_len = max((len(p) for p, _ in self.pieces), default=1)
        # a character trie of the pieces (a node's score under the key ""): the lattice scan walks it from each
        # start and stops at the first character no piece continues with
        self.trie: dict = {}
        for p, sc in self.scores.items():
            node = self.trie
            for ch in p:
                node = node.setdefault(ch, {})
            node[""] = sc

    def viterbi(self, word: str) -> list[str]:
        """Best segmentation of `word` as strings; unknown stretches come back as one string each."""
        n = len(word)
        trie, max_len = self.trie, self.max_len
        unk_score = self.min_score - UNK_PENALTY
        best = [0.0] + [None] * n  # best path score ending at position i
        back = [0] * (n + 1)
        is_unk = [False] * (n + 1)
        for start in range(n):
            base = best[start]
            if base is None:
                continue
            single = False
            node, end = trie, start
            for ch in word[start:start + max_len]:
                node = node.get(ch)
                if node is None:
                    break
                end += 1
                s = node.get("")
                if s is None:
                    continue
                if end == start + 1:
                    single = True
                cand = base + s
                b = best[end]
                if b is None or cand > b:
                    best[end], back[end], is_unk[end] = cand, start, False
            if not single:
                cand = base + unk_score
                end = start + 1
                if best[end] is None or cand > best[end]:
                    if self.unk_id is None:  # HF fails here, even when a longer piece or byte fallback would cover it
                        raise TokenizerError(f"Unigram: no piece is the character {word[start]!r} and the model has "
                                             "no unk_id; train with an unk token or add one")
                    best[end], back[end], is_unk[end] = cand, start, True
        out: list[str] = []
        end, unk_run = n, []
        while end > 0:
            start = back[end]
            if is_unk[end] and self.unk_id is not None:
                unk_run.append(word[start:end])
            else:
                if unk_run:
                    out.append("".join(reversed(unk_run)))
                    unk_run = []
                out.append(word[start:end])
            end = start
        if unk_run:
            out.append("".join(reversed(unk_run)))
        out.reverse()
        return out

    def vocab_size(self) -> int:
        return len(self.pieces)  # a piece listed twice counts twice, as in HF

    def id_to_token(self, i: int) -> str | None:
        return self.pieces[i][0] if 0 <= i < len(self.pieces) else None

    def tokenize(self, word: str) -> list[str]:
        out = []
        for piece in self.viterbi(word):
            if piece in self.vocab:
                out.append(piece)
                continue
            if self.byte_fallback:
                codes = [f"<0x{b:02X}>" for b in piece.encode("utf-8")]
                if all(c in self.vocab for c in codes):
                    out.extend(codes)
                    continue
            if self.unk_id is None:
                raise TokenizerError(f"Unigram: no piece covers {piece!r} and the model has no unk_id; "
                                     "train with an unk token or add one")
            out.append(piece)  # the unknown text itself, as HF's token string; its id is unk_id
        return out

    def tokenize_ids(self, word: str) -> list[int]:
        vocab = self.vocab
        return [vocab[t] for t in self.tokenize(word)] if self.unk_id is None else \
            [vocab.get(t, self.unk_id) for t in self.tokenize(word)]

    def score(self, tokens: list[str]) -> float:
        """Log-probability of a segmentation (sum of piece scores; unk, or text no piece covers, scores min - 10)."""
        unk = self.min_score - UNK_PENALTY
        return sum(self.scores.get(t, unk) if (self.unk_id is None or t != self.pieces[self.unk_id][0]) else unk
                   for t in tokens)

    def to_json(self) -> dict:
        return {"type": "Unigram", "unk_id": self.unk_id, "vocab": [[p, s] for p, s in self.pieces],
                "byte_fallback": self.byte_fallback}

    @classmethod
    def from_json(cls, d: dict) -> Unigram:
        return cls([(p, s) for p, s in d["vocab"]], d.get("unk_id"), d.get("byte_fallback", False))
