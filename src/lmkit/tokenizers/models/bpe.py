"""BPE model: a word starts as its characters, then the adjacent pair of lowest merge rank is merged
until no adjacent pair is a merge (Sennrich et al. 2016; GPT-2 applies it to byte-level words)."""
from __future__ import annotations

from lmkit.errors import TokenizerError
from lmkit.tokenizers.models.base import Model


class BPE(Model):
    type_name = "BPE"

    def __init__(self, vocab: dict[str, int], merges: list[tuple[str, str]], unk_token: str | None = None,
                 continuing_subword_prefix: str | None = None, end_of_word_suffix: str | None = None,
                 fuse_unk: bool = False, byte_fallback: bool = False, ignore_merges: bool = False,
                 dropout: float | None = None):
        super().__init__(vocab)
        if dropout:
            raise TokenizerError("BPE dropout is not supported by lmkit; set \"dropout\": null in tokenizer.json")
        self.merges = [tuple(m) for m in merges]
        self.unk_token, self.prefix, self.suffix = unk_token, continuing_subword_prefix, end_of_word_suffix
        self.fuse_unk, self.byte_fallback, self.ignore_merges = fuse_unk, byte_fallback, ignore_merges
        self.ranks: dict[tuple[str, str], int] = {}
        self.merged: dict[tuple[str, str], str] = {}
        plen = len(self.prefix) if self.prefix else 0
        for rank, (a, b) in enumerate(self.merges):
            new = a + (b[plen:] if plen and b.startswith(self.prefix) else b)
            if a not in vocab or b not in vocab:
                raise TokenizerError(f"BPE merge {a!r} {b!r} uses a token missing from the vocabulary")
            if new not in vocab:
                raise TokenizerError(f"BPE merge {a!r} {b!r} makes {new!r}, which is missing from the vocabulary")
            self.ranks.setdefault((a, b), rank)
            self.merged[(a, b)] = new
        self.unk_id = vocab.get(unk_token) if unk_token is not None else None

    def _symbols(self, word: str) -> list[str]:
        """Initial symbols: characters (with prefix/suffix), unknown ones as byte tokens, unk or dropped. As in
        HF, an unk is written when the next known character comes (or at the end), so byte tokens in between go
        before it and, with fuse_unk, unknown characters on both sides of them make one unk."""
        vocab, out, last = self.vocab, [], len(word) - 1
        pending = False
        for i, c in enumerate(word):
            s = c
            if i and self.prefix:
                s = self.prefix + s
            if i == last and self.suffix:
                s = s + self.suffix
            if s in vocab:
                if pending:
                    out.append(self.unk_token)
                    pending = False
                out.append(s)
                continue
            if self.byte_fallback:  # the bytes of the symbol, prefix and suffix included, as HF does
                pieces = [f"<0x{b:02X}>" for b in s.encode("utf-8")]
                if all(p in vocab for p in pieces):
                    out.extend(pieces)
                    continue
            if self.unk_token is not None:
                if self.unk_id is None:
                    raise TokenizerError(f"BPE unk_token {self.unk_token!r} is not in the vocabulary")
                if pending and not self.fuse_unk:
                    out.append(self.unk_token)
                pending = True
        if pending:
            out.append(self.unk_token)
        return out

    def tokenize(self, word: str) -> list[str]:
        if self.ignore_merges and word in self.vocab:
            return [word]
        symbols = self._symbols(word)
        ranks, merged = self.ranks, self.merged
        while len(symbols) > 1:
            best, best_rank = None, None
            for pair in zip(symbols, symbols[1:]):
                r = ranks.get(pair)
                if r is not None and (best_rank is None or r < best_rank):
                    best, best_rank = pair, r
            if best is None:
                break
            a, b = best
            new, out, i, n = merged[best], [], 0, len(symbols)
            while i < n:
                if i < n - 1 and symbols[i] == a and symbols[i + 1] == b:
                    out.append(new)
                    i += 2
                else:
                    out.append(symbols[i])
                    i += 1
            symbols = out
        return symbols

    def to_json(self) -> dict:
        return {"type": "BPE", "dropout": None, "unk_token": self.unk_token,
                "continuing_subword_prefix": self.prefix, "end_of_word_suffix": self.suffix,
                "fuse_unk": self.fuse_unk, "byte_fallback": self.byte_fallback, "ignore_merges": self.ignore_merges,
                "vocab": self.vocab, "merges": [list(m) for m in self.merges]}

    @classmethod
    def from_json(cls, d: dict) -> BPE:
        merges = [tuple(m.split(" ", 1)) if isinstance(m, str) else tuple(m) for m in d.get("merges", [])]
        return cls(d["vocab"], merges, d.get("unk_token"), d.get("continuing_subword_prefix"),
                   d.get("end_of_word_suffix"), d.get("fuse_unk", False), d.get("byte_fallback", False),
                   d.get("ignore_merges", False), d.get("dropout"))
