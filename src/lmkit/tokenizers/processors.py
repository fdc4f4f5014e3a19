"""Post-processors: wrap one or two encoded sequences with special tokens and give token type ids
(`[CLS] A [SEP] B [SEP]` with types 0...0 1...1 for BERT, `<s> A </s></s> B </s>` for RoBERTa).

As in `tokenizers`, a processor runs even with add_special_tokens=False: it then adds no special token, but a
template still orders the sequences and gives their type ids, and RoBERTa's still makes every type id 0."""
from __future__ import annotations

from lmkit.errors import TokenizerError

Triple = tuple[list[int], list[int], list[int]]  # ids, type ids, special-token mask


def plain(a: list[int], b: list[int] | None) -> Triple:
    """No special tokens: A has type 0, B type 1."""
    ids = a + (b or [])
    return ids, [0] * len(a) + [1] * len(b or []), [0] * len(ids)


class PostProcessor:
    type_name = ""

    def added_tokens(self, is_pair: bool) -> int:
        return 0

    def process(self, a: list[int], b: list[int] | None, add_special_tokens: bool = True) -> Triple:
        return plain(a, b)

    def to_json(self) -> dict:
        return {"type": self.type_name}


class ByteLevel(PostProcessor):
    """Only trims offsets in HF; ids pass through unchanged."""

    type_name = "ByteLevel"

    def __init__(self, add_prefix_space: bool = True, trim_offsets: bool = True, use_regex: bool = True):
        self.add_prefix_space, self.trim_offsets, self.use_regex = add_prefix_space, trim_offsets, use_regex

    def to_json(self) -> dict:
        return {"type": "ByteLevel", "add_prefix_space": self.add_prefix_space, "trim_offsets": self.trim_offsets,
                "use_regex": self.use_regex}


class TemplateProcessing(PostProcessor):
    """`single` and `pair` are lists of pieces: {"Sequence": {"id": "A"|"B", "type_id": t}} or
    {"SpecialToken": {"id": name, "type_id": t}}; `special_tokens` maps a name to its ids."""

    type_name = "TemplateProcessing"

    def __init__(self, single: list, pair: list, special_tokens: dict):
        self.single, self.pair = [self._piece(p) for p in single], [self._piece(p) for p in pair]
        self.special_tokens = special_tokens
        for kind, name, _ in self.single + self.pair:
            if kind == "SpecialToken" and name not in special_tokens:
                raise TokenizerError(f"TemplateProcessing uses special token {name!r} but does not define its ids")

    @staticmethod
    def _piece(p) -> tuple[str, str, int]:
        if isinstance(p, str):  # the short "$A:0" / "[CLS]:0" form of the Python API
            name, _, t = p.partition(":")
            t = int(t or 0)
            if name.startswith("$"):
                return "Sequence", (name[1:] or "A"), t
            return "SpecialToken", name, t
        (kind, body), = p.items()
        return kind, body["id"], int(body.get("type_id", 0))

    def added_tokens(self, is_pair: bool) -> int:
        tmpl = self.pair if is_pair else self.single
        return sum(len(self.special_tokens[n]["ids"]) for k, n, _ in tmpl if k == "SpecialToken")

    def process(self, a: list[int], b: list[int] | None, add_special_tokens: bool = True) -> Triple:
        ids, types, special = [], [], []
        for kind, name, t in (self.pair if b is not None else self.single):
            if kind == "SpecialToken" and not add_special_tokens:
                continue
            part = (a if name == "A" else b) if kind == "Sequence" else self.special_tokens[name]["ids"]
            ids += part
            types += [t] * len(part)
            special += [int(kind == "SpecialToken")] * len(part)
        return ids, types, special

    def to_json(self) -> dict:
        def dump(tmpl):
            return [{kind: {"id": name, "type_id": t}} for kind, name, t in tmpl]
        return {"type": self.type_name, "single": dump(self.single), "pair": dump(self.pair),
                "special_tokens": self.special_tokens}


def bert_template(cls: str, cls_id: int, sep: str, sep_id: int) -> TemplateProcessing:
    """BERT's frame as transformers' BertTokenizerFast builds it: `[CLS] A [SEP]` (type 0) and
    `[CLS] A [SEP] B [SEP]` (B and its [SEP] type 1); [CLS] and [SEP] may be one token."""
    special = {name: {"id": name, "ids": [int(i)], "tokens": [name]} for name, i in ((cls, cls_id), (sep, sep_id))}
    return TemplateProcessing([f"{cls}:0", "$A:0", f"{sep}:0"], [f"{cls}:0", "$A:0", f"{sep}:0", "$B:1", f"{sep}:1"],
                              special)


class BertProcessing(PostProcessor):
    """`[CLS] A [SEP]` and `[CLS] A [SEP] B [SEP]`, B and its [SEP] with type 1."""

    type_name = "BertProcessing"

    def __init__(self, sep: tuple[str, int], cls: tuple[str, int]):
        self.sep, self.cls = tuple(sep), tuple(cls)

    def added_tokens(self, is_pair: bool) -> int:
        return 3 if is_pair else 2

    def process(self, a: list[int], b: list[int] | None, add_special_tokens: bool = True) -> Triple:
        if not add_special_tokens:
            return plain(a, b)
        c, s = self.cls[1], self.sep[1]
        ids = [c] + a + [s]
        types, special = [0] * len(ids), [1] + [0] * len(a) + [1]
        if b is not None:
            ids += b + [s]
            types += [1] * (len(b) + 1)
            special += [0] * len(b) + [1]
        return ids, types, special

    def to_json(self) -> dict:
        return {"type": self.type_name, "sep": list(self.sep), "cls": list(self.cls)}


class RobertaProcessing(BertProcessing):
    """`<s> A </s>` and `<s> A </s> </s> B </s>`; every type id is 0 (RoBERTa has no segment embedding)."""

    type_name = "RobertaProcessing"

    def __init__(self, sep, cls, trim_offsets: bool = True, add_prefix_space: bool = True):
        super().__init__(sep, cls)
        self.trim_offsets, self.add_prefix_space = trim_offsets, add_prefix_space

    def added_tokens(self, is_pair: bool) -> int:
        return 4 if is_pair else 2

    def process(self, a: list[int], b: list[int] | None, add_special_tokens: bool = True) -> Triple:
        if not add_special_tokens:
            ids = a + (b or [])
            return ids, [0] * len(ids), [0] * len(ids)
        c, s = self.cls[1], self.sep[1]
        ids = [c] + a + [s]
        special = [1] + [0] * len(a) + [1]
        if b is not None:
            ids += [s] + b + [s]
            special += [1] + [0] * len(b) + [1]
        return ids, [0] * len(ids), special

    def to_json(self) -> dict:
        return {"type": self.type_name, "sep": list(self.sep), "cls": list(self.cls),
                "trim_offsets": self.trim_offsets, "add_prefix_space": self.add_prefix_space}


class Sequence(PostProcessor):
    """Processors in turn; ByteLevel ones leave ids alone, so at most one other processor may be in it."""

    type_name = "Sequence"

    def __init__(self, processors: list[PostProcessor]):
        self.processors = list(processors)
        active = [p for p in self.processors if not isinstance(p, ByteLevel)]
        if len(active) > 1:
            raise TokenizerError("a Sequence post_processor with more than one special-token processor is not supported")
        self.active = active[0] if active else None

    def added_tokens(self, is_pair: bool) -> int:
        return self.active.added_tokens(is_pair) if self.active else 0

    def process(self, a, b, add_special_tokens: bool = True):
        return self.active.process(a, b, add_special_tokens) if self.active else plain(a, b)

    def to_json(self) -> dict:
        return {"type": self.type_name, "processors": [p.to_json() for p in self.processors]}


def post_processor_from_json(d: dict | None) -> PostProcessor | None:
    if d is None:
        return None
    kind = d.get("type")
    if kind == "TemplateProcessing":
        return TemplateProcessing(d["single"], d["pair"], d.get("special_tokens", {}))
    if kind == "BertProcessing":
        return BertProcessing(d["sep"], d["cls"])
    if kind == "RobertaProcessing":
        return RobertaProcessing(d["sep"], d["cls"], d.get("trim_offsets", True), d.get("add_prefix_space", True))
    if kind == "ByteLevel":
        return ByteLevel(d.get("add_prefix_space", True), d.get("trim_offsets", True), d.get("use_regex", True))
    if kind == "Sequence":
        return Sequence([post_processor_from_json(x) for x in d["processors"]])
    raise TokenizerError(f"unsupported post_processor type {kind!r} in tokenizer.json; lmkit reads TemplateProcessing, "
                         "BertProcessing, RobertaProcessing, ByteLevel and Sequence")
