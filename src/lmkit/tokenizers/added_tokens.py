"""Added tokens (special tokens among them): found in the text before anything else runs, so they are never
split or merged. Matching is leftmost-longest, as HF's Aho-Corasick; `normalized=False` tokens are matched on
the raw text, `normalized=True` ones on the normalized text; lstrip/rstrip swallow the adjacent whitespace;
single_word tokens only match between non-word characters."""
from __future__ import annotations

from dataclasses import asdict, dataclass

import regex

from lmkit.tokenizers.chars import is_whitespace

_WORD = regex.compile(r"\w")


@dataclass
class AddedToken:
    content: str
    id: int = -1
    single_word: bool = False
    lstrip: bool = False
    rstrip: bool = False
    normalized: bool = False
    special: bool = True

    def to_json(self) -> dict:
        d = asdict(self)
        return {"id": d.pop("id"), "content": d.pop("content"), **d}


def _pattern(contents: list[str]) -> regex.Pattern | None:
    if not contents:
        return None
    return regex.compile("|".join(regex.escape(c) for c in sorted(set(contents), key=len, reverse=True)))


class AddedVocabulary:
    def __init__(self, tokens: list[AddedToken] = (), normalizer=None):
        self.tokens: list[AddedToken] = []
        self.normalizer = normalizer
        for t in tokens:
            self.add(t, rebuild=False)
        self._rebuild()

    def add(self, token: AddedToken, rebuild: bool = True) -> None:
        """Add `token`; as in HF, an empty one is ignored and one whose content is there already replaces it
        (its flags and specialness change, its id stays)."""
        if not token.content:
            return
        same = [i for i, t in enumerate(self.tokens) if t.content == token.content]
        if same:
            token.id = self.tokens[same[0]].id
            self.tokens[same[0]] = token
        else:
            self.tokens.append(token)
        if rebuild:
            self._rebuild()

    def _rebuild(self) -> None:
        self.by_content = {t.content: t for t in self.tokens}
        self.by_id = {t.id: t for t in self.tokens}
        self.special_ids = {t.id for t in self.tokens if t.special}
        # HF decodes a normalized added token to its normalized form
        self.id_to_content = {t.id: (self.normalizer.normalize(t.content) if t.normalized and self.normalizer
                                     else t.content) for t in self.tokens}
        # HF skips on decode any token whose string is the content of a special token, so a normalized special
        # token that changes is kept, and any id that decodes to a special token's content is dropped
        self.special_contents = {t.content for t in self.tokens if t.special}
        raw = [t for t in self.tokens if not t.normalized]
        norm = [t for t in self.tokens if t.normalized]
        self._raw = (_pattern([t.content for t in raw]), {t.content: t for t in raw})
        normed = {(self.normalizer.normalize(t.content) if self.normalizer else t.content): t for t in norm}
        self._norm = (_pattern(list(normed)), normed)

    def __len__(self) -> int:
        return len(self.tokens)

    @staticmethod
    def _find(text: str, pattern, table) -> list[tuple[int, int, int]]:
        """(start, end, id) of each match, with lstrip/rstrip/single_word applied as HF's find_matches: matches
        are found on the text alone (an rstrip that swallows the space a later match starts with does not
        hide that match), and lstrip never reaches back past the previous token's end."""
        out, pos, floor, last_end = [], 0, 0, None
        while pattern is not None and pos <= len(text):
            m = pattern.search(text, pos)
            if m is None:
                break
            s, e = m.span()
            # a token the normalizer empties matches the empty string, as HF's matcher does: anywhere but right
            # where the previous match ended, moving on one character after it (its empty piece is dropped later)
            pos = e + 1 if s == e else e
            if s == e == last_end:
                continue
            last_end = e
            tok = table[m.group()]
            if tok.single_word and ((s > 0 and _WORD.match(text[s - 1])) or (e < len(text) and _WORD.match(text[e]))):
                continue
            if tok.lstrip:
                while s > 0 and is_whitespace(text[s - 1]):
                    s -= 1
                s = max(s, floor)
            if tok.rstrip:
                while e < len(text) and is_whitespace(text[e]):
                    e += 1
            out.append((s, e, tok.id))
            floor = e
        return out

    def split(self, text: str) -> list[tuple[str, int | None, bool]]:
        """[(piece, added-token id or None, starts at the text's start)]; pieces with None are normalized (a
        normalizer that removes a piece's first character moves its start, as HF's alignments do)."""
        out = []
        for piece, tid, first in self._cut(text, *self._raw, True):
            if tid is not None:
                out.append((piece, tid, first))
                continue
            if self.normalizer is not None:
                piece, kept = self.normalizer.normalize_start(piece)
                first = first and kept
            if self._norm[0] is None:
                out.append((piece, None, first))
            else:
                out.extend(self._cut(piece, *self._norm, first))
        return out

    def _cut(self, text, pattern, table, first):
        if pattern is None:
            return [(text, None, first)] if text else []
        out, prev = [], 0
        for s, e, tid in self._find(text, pattern, table):
            if s > prev:
                out.append((text[prev:s], None, first and prev == 0))
            if e > s:
                out.append((text[s:e], tid, first and s == 0))
            prev = e
        if prev < len(text):
            out.append((text[prev:], None, first and prev == 0))
        return out

    def to_json(self) -> list[dict]:
        return [t.to_json() for t in sorted(self.tokens, key=lambda t: t.id)]

    @classmethod
    def from_json(cls, items: list[dict], normalizer=None, model=None) -> AddedVocabulary:
        """Tokens from tokenizer.json. Given the model, ids are the ones HF gives when it loads the file, not the
        stored ones: the model's id of the content, else the next id after the vocabulary and the added tokens
        so far (HF warns when they differ; a file it wrote itself always agrees)."""
        toks = [AddedToken(d["content"], d["id"], d.get("single_word", False), d.get("lstrip", False),
                           d.get("rstrip", False), d.get("normalized", False), d.get("special", False)) for d in items]
        if model is not None:
            size, given = model.vocab_size(), {}
            for t in toks:
                if not t.content:
                    continue
                tid = given.get(t.content, model.token_to_id(t.content))
                if tid is None:
                    tid = max([size, *(i + 1 for i in given.values())])  # the next id after all given so far
                t.id = given[t.content] = tid
        return cls(toks, normalizer)
