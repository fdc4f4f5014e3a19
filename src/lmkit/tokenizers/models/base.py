"""The model interface: a word (one pre-token) -> its token strings; plus the vocabulary both ways."""
from __future__ import annotations


class Model:
    type_name = ""

    def __init__(self, vocab: dict[str, int]):
        self.vocab = dict(vocab)
        self.inverse = {i: t for t, i in self.vocab.items()}

    def tokenize(self, word: str) -> list[str]:
        raise NotImplementedError

    def tokenize_ids(self, word: str) -> list[int]:
        vocab = self.vocab
        return [vocab[t] for t in self.tokenize(word)]

    def token_to_id(self, token: str) -> int | None:
        return self.vocab.get(token)

    def id_to_token(self, i: int) -> str | None:
        return self.inverse.get(i)

    def vocab_size(self) -> int:
        return len(self.vocab)

    def to_json(self) -> dict:
        raise NotImplementedError
