"""WordPiece model (BERT): greedy longest-match-first; pieces after the first carry the `##` prefix;
a word with no full cover, or longer than max_input_chars_per_word, becomes the single unk token."""
from __future__ import annotations

from lmkit.errors import TokenizerError
from lmkit.tokenizers.models.base import Model


class WordPiece(Model):
    type_name = "WordPiece"

    def __init__(self, vocab: dict[str, int], unk_token: str = "[UNK]", continuing_subword_prefix: str = "##",
                 max_input_chars_per_word: int = 100):
        super().__init__(vocab)
        self.unk_token, self.prefix, self.max_chars = unk_token, continuing_subword_prefix, max_input_chars_per_word
        self.max_len = max((len(t) for t in self.vocab), default=1)

    def tokenize(self, word: str) -> list[str]:
        vocab, n = self.vocab, len(word)
        if n > self.max_chars:
            return [self._unk()]
        if word in vocab:
            return [word]
        out, start, prefix, max_len = [], 0, self.prefix, self.max_len
        while start < n:
            end = min(n, start + max_len)
            while end > start:
                piece = word[start:end] if not start else prefix + word[start:end]
                if piece in vocab:
                    break
                end -= 1
            else:
                return [self._unk()]
            out.append(piece)
            start = end
        return out

    def _unk(self) -> str:
        if self.unk_token not in self.vocab:
            raise TokenizerError(f"WordPiece unk_token {self.unk_token!r} is not in the vocabulary")
        return self.unk_token

    def to_json(self) -> dict:
        return {"type": "WordPiece", "unk_token": self.unk_token, "continuing_subword_prefix": self.prefix,
                "max_input_chars_per_word": self.max_chars, "vocab": self.vocab}

    @classmethod
    def from_json(cls, d: dict) -> WordPiece:
        return cls(d["vocab"], d.get("unk_token", "[UNK]"), d.get("continuing_subword_prefix", "##"),
                   d.get("max_input_chars_per_word", 100))


class WordLevel(Model):
    """One id per whole word; words outside the vocabulary map to the unk token."""

    type_name = "WordLevel"

    def __init__(self, vocab: dict[str, int], unk_token: str | None = "[UNK]"):
        super().__init__(vocab)
        self.unk_token = unk_token

    def tokenize(self, word: str) -> list[str]:
        if word in self.vocab:
            return [word]
        if self.unk_token is None or self.unk_token not in self.vocab:
            raise TokenizerError(f"WordLevel: {word!r} is not in the vocabulary and unk_token {self.unk_token!r} is "
                                 "missing from it; add an unk token")
        return [self.unk_token]

    def to_json(self) -> dict:
        return {"type": "WordLevel", "vocab": self.vocab, "unk_token": self.unk_token}

    @classmethod
    def from_json(cls, d: dict) -> WordLevel:
        return cls(d["vocab"], d.get("unk_token"))
