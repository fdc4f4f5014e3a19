"""`pydocs-instruct`: instruction/response pairs built from the same interpreter material as `pydocs`.

For each function, class and module docstring of the standard library, and each reference topic:
    "What does `json.dumps` do?"            -> the first paragraph of its docstring (at most MAX_ANSWER characters,
                                               cut at a sentence end)
    "Show the signature of `json.dumps`."   -> "json.dumps(obj, *, skipkeys=False, ...)" (functions, from the AST)
    "What does the Python reference say about `assert`?" -> the topic's first paragraph
Every pair carries the id of the pydocs document it comes from (`doc:MODULE`, `topic:NAME`), and the split is
pydocs' own (`Corpus.split` on those documents), so no validation instruction comes from a training document.
Deterministic: files are read in sorted order, and nothing is downloaded.
"""
from __future__ import annotations

import ast
import re

import json

from lmkit.atomic import atomic_write_json
from lmkit.data.builtin import _cache_path, _parse, builtin_corpus, stdlib_files
from lmkit.data.documents import VAL_FRACTION
from lmkit.errors import CorpusError

NAME = "pydocs-instruct"
MAX_ANSWER = 300
_SENTENCE_END = re.compile(r"[.!?](?=\s|$)")


def first_paragraph(text: str, limit: int = MAX_ANSWER) -> str:
    """The first paragraph, lines joined; cut at the last sentence end within `limit` characters (else a word)."""
    para = " ".join(text.strip().split("\n\n")[0].split())
    if len(para) <= limit:
        return para
    ends = [m.end() for m in _SENTENCE_END.finditer(para, 0, limit)]
    if ends:
        return para[:ends[-1]]
    return para[:limit].rsplit(" ", 1)[0] + " ..."


def _signature(name: str, node: ast.FunctionDef | ast.AsyncFunctionDef) -> str:
    args = ast.unparse(node.args)
    if args.startswith("self, ") or args == "self":
        args = args.removeprefix("self").removeprefix(", ")
    return f"{name}({args})"


def _module_pairs(module: str, tree: ast.Module) -> list[dict]:
    pairs = []

    def add(name, doc, node=None):
        answer = first_paragraph(doc)
        if len(answer) >= 20:  # one-word docstrings ("Constructor.") teach nothing
            pairs.append({"instruction": f"What does `{name}` do?", "response": answer})
        if node is not None and not name.rsplit(".", 1)[-1].startswith("_"):
            pairs.append({"instruction": f"Show the signature of `{name}`.", "response": _signature(name, node)})

    def visit(node, prefix):
        for child in ast.iter_child_nodes(node):
            if isinstance(child, (ast.ClassDef, ast.FunctionDef, ast.AsyncFunctionDef)):
                name = f"{prefix}.{child.name}"
                if child.name.startswith("_") and not child.name.startswith("__init__"):
                    continue
                doc = ast.get_docstring(child, clean=True)
                if doc:
                    add(name, doc, child if not isinstance(child, ast.ClassDef) else None)
                visit(child, name)

    doc = ast.get_docstring(tree, clean=True)
    if doc:
        add(module, doc)
    visit(tree, module)
    return pairs


def build_pydocs_instruct(use_cache: bool = True) -> list[dict]:
    """Every pair, in a fixed order: {"id", "doc", "instruction", "response"} (cached as pydocs is)."""
    path = _cache_path(NAME)
    if use_cache and path.exists():
        try:
            return json.loads(path.read_text(encoding="utf-8"))["rows"]
        except (ValueError, KeyError, TypeError):
            pass  # a damaged cache file is rebuilt
    rows = _build()
    if use_cache:
        atomic_write_json(path, {"name": NAME, "rows": rows}, indent=None)
    return rows


def _build() -> list[dict]:
    from pydoc_data.topics import topics

    rows = []
    for name in sorted(topics):
        text = topics[name].strip()
        if text:
            answer = first_paragraph(text)
            rows.append({"doc": f"topic:{name}", "instruction": f"What does the Python reference say about `{name}`?",
                         "response": answer})
    for module, path in stdlib_files():
        parsed = _parse(path)
        if parsed is not None:
            rows += [{"doc": f"doc:{module}", **p} for p in _module_pairs(module, parsed[1])]
    for i, r in enumerate(rows):
        r["id"] = f"{r['doc']}#{i}"
    return rows


def pydocs_instruct(split: str = "train", val_fraction: float = VAL_FRACTION) -> list[dict]:
    """The pairs of pydocs' train or validation documents, as SFT rows with "messages" (plus "id" and "doc")."""
    if split not in ("train", "validation"):

        raise CorpusError(f"{NAME} has the splits train and validation, not {split!r}")
    _, val = builtin_corpus("pydocs").split(val_fraction)
    held = {d.id for d in val}
    return [{"id": r["id"], "doc": r["doc"],
             "messages": [{"role": "user", "content": r["instruction"]},
                          {"role": "assistant", "content": r["response"]}]}
            for r in build_pydocs_instruct() if (r["doc"] in held) == (split == "validation")]


def pydocs_preference(split: str = "train", seed: int = 0) -> list[dict]:
    """`pydocs-preference`: conversational preference rows from pydocs-instruct's pairs. chosen = the reference
    answer; rejected = the answer to another symbol's question of the same kind (a docstring paragraph for a
    docstring question, a signature for a signature question), drawn with a seeded generator from the same split
    and different in text: fluent Python-docs prose about the wrong symbol, so a pair rewards grounding in the
    question rather than style or length."""
    import random

    rows = pydocs_instruct(split)
    kinds: dict[str, list[int]] = {}
    for i, r in enumerate(rows):
        kinds.setdefault(re.sub(r"`[^`]*`", "`X`", r["messages"][0]["content"]), []).append(i)
    rng, out = random.Random(seed), []
    for i, r in enumerate(rows):
        same = kinds[re.sub(r"`[^`]*`", "`X`", r["messages"][0]["content"])]
        answer = r["messages"][-1]["content"]
        others = [j for j in (same[rng.randrange(len(same))] for _ in range(8)) if rows[j]["messages"][-1]["content"] != answer]
        if not others:  # a kind with one answer text only: no wrong answer of its kind to give
            continue
        out.append({"id": r["id"], "doc": r["doc"], "prompt": r["messages"][:-1], "chosen": [r["messages"][-1]],
                    "rejected": [{"role": "assistant", "content": rows[others[0]]["messages"][-1]["content"]}]})
    return out
