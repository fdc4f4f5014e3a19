"""`pydocs-ner`: word-tagged sentences built from the `pydocs` corpus (nothing downloaded, deterministic).

Every `doc:MODULE` document lists its docstrings under their dotted names (data/builtin.py); those names are the
gazetteer. A word of a docstring (surrounding quotes, brackets and punctuation aside) is tagged B-MOD when it is the
name of a documented module written as code or followed by "module", B-CLS / B-FUNC when it is the dotted name of a documented class / function, or when it
is written as code (backticks, a call `()`, a dot or an underscore) and its last part names one (CapWords: a class);
everything else is O. Sentences are the docstrings' lines joined and cut at full stops (at most MAX_WORDS words);
those with at least one entity are kept, at most PER_DOC per document. The train / validation split is pydocs'
own, by document, so no validation sentence comes from a training document.
"""
from __future__ import annotations

import re

from lmkit.data.builtin import builtin_corpus
from lmkit.data.documents import VAL_FRACTION
from lmkit.errors import CorpusError

NAME = "pydocs-ner"
LABELS = ("O", "B-CLS", "B-FUNC", "B-MOD")
MAX_WORDS, PER_DOC = 40, 20
_HEADER = re.compile(r"^[A-Za-z_][\w.]*$")
_EDGES = "`'\"()[]{},.:;!?*"


def _names(corpus) -> tuple[set[str], dict[str, str]]:
    """(module names, {dotted or last-part name: CLS | FUNC}) of the documented objects."""
    modules = {d.id[4:] for d in corpus if d.id.startswith("doc:")}
    kinds: dict[str, str] = {}
    for d in corpus:
        if not d.id.startswith("doc:"):
            continue
        for block in d.text.split("\n\n"):
            head = block.split("\n", 1)[0].strip()
            if _HEADER.match(head) and "." in head and head not in modules:
                last = head.rsplit(".", 1)[1]
                kind = "CLS" if last[:1].isupper() else "FUNC"
                kinds[head] = kind
                kinds.setdefault(last, kind)
    return modules, kinds


def tag_word(word: str, modules: set[str], kinds: dict[str, str], following: str = "") -> str:
    """The tag of one whitespace-separated word (module docstring); `following`: the next word."""
    bare = word.strip(_EDGES)
    code = "`" in word or "()" in word or "_" in bare or "." in bare
    bare = bare.removesuffix("()")
    if bare in modules and (code or following.startswith("module")):
        return "B-MOD"
    if "." in bare and bare in kinds:
        return f"B-{kinds[bare]}"
    last = bare.rsplit(".", 1)[-1]
    if code and last in kinds and len(last) > 1:
        return f"B-{kinds[last]}"
    return "O"


def sentences(text: str) -> list[list[str]]:
    """The words of each sentence of a document (paragraphs joined, cut after full stops and MAX_WORDS words)."""
    out = []
    for para in text.split("\n\n"):
        words, current = para.split(), []
        for w in words:
            current.append(w)
            if w.endswith((".", "?", "!")) and not w.endswith("..") or len(current) == MAX_WORDS:
                out.append(current)
                current = []
        if current:
            out.append(current)
    return out


def pydocs_ner(split: str = "train", val_fraction: float = VAL_FRACTION) -> list[dict]:
    """Rows {"id", "doc", "tokens", "tags"} of pydocs' train or validation documents."""
    if split not in ("train", "validation"):
        raise CorpusError(f"{NAME} has the splits train and validation, not {split!r}")
    corpus = builtin_corpus("pydocs")
    modules, kinds = _names(corpus)
    train, val = corpus.split(val_fraction)
    rows = []
    for doc in (train if split == "train" else val):
        if not doc.id.startswith("doc:"):
            continue
        kept = 0
        for s in sentences(doc.text):
            if len(s) < 3:
                continue
            tags = [tag_word(w, modules, kinds, n) for w, n in zip(s, s[1:] + [""])]
            if any(t != "O" for t in tags) and kept < PER_DOC:
                rows.append({"id": f"{doc.id}#{kept}", "doc": doc.id, "tokens": s, "tags": tags})
                kept += 1
    return rows


# pydocs-qa: extractive questions whose answers are spans of docstrings -------------------------------------------

QA_NAME = "pydocs-qa"
QA_ENTRIES = 3  # documented objects per context


def _entries(text: str) -> list[tuple[str, str]]:
    """(dotted name, first paragraph of its docstring, lines joined) of a pydocs `doc:` document."""
    out, blocks = [], text.split("\n\n")
    for block in blocks:
        head, _, rest = block.partition("\n")
        if _HEADER.match(head.strip()) and rest.strip():
            out.append((head.strip(), " ".join(rest.split())))
    return out


def _first_sentence(paragraph: str) -> str:
    match = re.search(r"[.!?](?=\s|$)", paragraph)
    return paragraph[:match.end()] if match else paragraph


def pydocs_qa(split: str = "train", val_fraction: float = VAL_FRACTION) -> list[dict]:
    """SQuAD-format rows {"id", "doc", "question", "context", "answers": {"text", "answer_start"}}: a context is
    QA_ENTRIES consecutive "name: paragraph" entries of one module; each question asks what one of them does, and
    its answer is the first sentence of that entry's paragraph (3 to 40 words), found in the context."""
    if split not in ("train", "validation"):
        raise CorpusError(f"{QA_NAME} has the splits train and validation, not {split!r}")
    train, val = builtin_corpus("pydocs").split(val_fraction)
    rows = []
    for doc in (train if split == "train" else val):
        if not doc.id.startswith("doc:"):
            continue
        entries = [(n, p) for n, p in _entries(doc.text) if len(p.split()) <= 80]
        for start in range(0, len(entries) - QA_ENTRIES + 1, QA_ENTRIES):
            group = entries[start:start + QA_ENTRIES]
            context, starts = "", []
            for name, para in group:
                context += ("" if not context else " ") + f"{name}: "
                starts.append(len(context))
                context += para
            for (name, para), at in zip(group, starts):
                answer = _first_sentence(para)
                if 3 <= len(answer.split()) <= 40:
                    rows.append({"id": f"{doc.id}#{len(rows)}", "doc": doc.id, "question": f"What does {name} do?",
                                 "context": context, "answers": {"text": [answer], "answer_start": [at]}})
    return rows
