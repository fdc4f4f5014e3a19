#!/usr/bin/env python3
"""Checks that the imports of src/lmkit follow the arrows of docs/architecture.md, and that no import closes a
circle between modules.

Arrows: the layer table of docs/architecture.md ("Layers and their import arrows") names, for each place (a
package or a top-level module), the lmkit places it may import; a name in a part marked "(lazy)" may only be
imported inside a function, "the top-level API" is `import lmkit`, "everything" is anything, and a place whose
imports are "nothing of lmkit" (errors, atomic writes, the progress bar) may be imported from every place. A
place the table does not name is an error too, so the table stays the map of the code.

Circles: the module import graph counts every import of lmkit, at module level or inside a function (a
function-local import that two modules need of each other only hides the circle until the function runs);
imports under `if TYPE_CHECKING:` never run and are left out. The function-local imports listed in the table
"Circles and the allowed function-local imports" of docs/architecture.md are left out too; KNOWN_CIRCLES below lists the
circles being broken elsewhere: they are reported, and fail the check only once they are gone from the code
(so the entry gets removed).

Also: tokenizers/ loads torch only inside a function, nothing but the command line imports `lmkit.cli`, and
modules past 400 lines are listed (not an error).

Usage: python tools/check_layers.py [PROJECT_ROOT]   (exit 1 when an arrow points the wrong way or a circle closes)
"""
from __future__ import annotations

import ast
import re
import sys
from pathlib import Path

# (module, lmkit module it imports): an import closing a circle that another change is breaking (most are made
# inside a function; train/objectives.py imports its objectives at the bottom of the file). Empty this once those
# changes are merged; an entry whose import is gone, or closes no circle any more, fails the check until removed.
KNOWN_CIRCLES: set[tuple[str, str]] = set()
# third-party names a place may import only inside a function: tokenizers stays torch-free on import
LAZY_THIRD_PARTY = {"tokenizers": {"torch"}}
LAYER_HEADING = "## Layers and their import arrows"
ALLOWED_HEADING = "### Circles and the allowed function-local imports"
TOP_LEVEL_API = "the top-level API"
FOUNDATION = "nothing of lmkit"


def table_rows(text: str, heading: str) -> list[list[str]]:
    """The cells of the first Markdown table under `heading` (header and separator left out)."""
    if heading not in text:
        raise SystemExit(f"docs/architecture.md has no {heading!r} section; the layer check reads its table")
    rows, started = [], False
    for line in text.split(heading, 1)[1].splitlines():
        if line.startswith("|"):
            started = True
            rows.append([c.strip() for c in line.strip().strip("|").split("|")])
        elif started:
            break
    return [r for r in rows[2:] if r]


def read_arrows(text: str) -> tuple[dict[str, set[str]], dict[str, set[str]]]:
    """(place -> places it may import, place -> those of them only inside a function) from the layer table;
    "*" stands for everything. The foundation, the places that import "nothing of lmkit", may be imported from
    anywhere."""
    allowed: dict[str, set[str]] = {}
    lazy: dict[str, set[str]] = {}
    foundation: set[str] = set()
    for place_cell, _, imports in table_rows(text, LAYER_HEADING):
        places = [n.removesuffix("/").removesuffix(".py") for n in re.findall(r"`([^`]+)`", place_cell)]
        may, only_lazy = set(), set()
        for part in imports.split(";"):
            # "(lazy...)" marks its part; another parenthesis is a comment on the name before it
            names = set(re.findall(r"`([^`]+)`", re.sub(r"\((?!lazy)[^)]*\)", "", part)))
            if TOP_LEVEL_API in part:
                names.add("lmkit")
            if part.strip().startswith("everything"):
                names.add("*")
            may |= names
            if "(lazy" in part:
                only_lazy |= names
        if imports.startswith(FOUNDATION):
            foundation.update(places)
        for p in places:
            allowed[p], lazy[p] = may, only_lazy
    for p, may in allowed.items():
        may |= foundation - {p}
    return allowed, lazy


def read_allowed_lazy(text: str) -> set[tuple[str, str]]:
    """(module, imported module) pairs from the table of allowed function-local imports."""
    if ALLOWED_HEADING not in text:
        return set()
    pairs = set()
    for row in table_rows(text, ALLOWED_HEADING):
        names = re.findall(r"`([^`]+)`", row[0])
        if len(names) == 2:
            pairs.add((names[0], names[1]))
    return pairs


class Module:
    """One source file: its dotted name, its place and the imports it makes."""

    def __init__(self, src: Path, path: Path):
        rel = path.relative_to(src.parent)
        self.path = path
        self.name = ".".join(rel.with_suffix("").parts).removesuffix(".__init__")
        self.package = self.name if path.name == "__init__.py" else self.name.rsplit(".", 1)[0]
        parts = self.name.split(".")
        self.place = parts[1] if len(parts) > 1 else "lmkit"
        self.lines = len(path.read_text(encoding="utf-8").splitlines())
        # (imported dotted name, the names taken from it, lazy?, under TYPE_CHECKING?)
        self.imports: list[tuple[str, list[str], bool, bool]] = []
        self._walk(ast.parse(path.read_text(encoding="utf-8")), lazy=False, typing_only=False)

    def _walk(self, node: ast.AST, lazy: bool, typing_only: bool) -> None:
        for child in ast.iter_child_nodes(node):
            if isinstance(child, ast.Import):
                self.imports += [(a.name, [], lazy, typing_only) for a in child.names]
            elif isinstance(child, ast.ImportFrom):
                base = child.module or ""
                if child.level:
                    pkg = self.package.split(".")
                    base = ".".join(pkg[: len(pkg) - child.level + 1] + ([child.module] if child.module else []))
                self.imports.append((base, [a.name for a in child.names], lazy, typing_only))
            elif isinstance(child, ast.If) and _is_type_checking(child.test):
                for stmt in child.body:
                    self._walk(ast.Module(body=[stmt], type_ignores=[]), lazy, True)
                for stmt in child.orelse:
                    self._walk(ast.Module(body=[stmt], type_ignores=[]), lazy, typing_only)
            else:
                inner = lazy or isinstance(child, (ast.FunctionDef, ast.AsyncFunctionDef, ast.Lambda))
                self._walk(child, inner, typing_only)


def _is_type_checking(test: ast.AST) -> bool:
    return (isinstance(test, ast.Name) and test.id == "TYPE_CHECKING") or \
        (isinstance(test, ast.Attribute) and test.attr == "TYPE_CHECKING")


def lmkit_targets(name: str, taken: list[str], modules: dict[str, Module]) -> list[str]:
    """The lmkit modules an import runs: `from a.b import c` runs a.b.c when that is a module, else a.b."""
    if name != "lmkit" and not name.startswith("lmkit."):
        return []
    subs = [f"{name}.{t}" for t in taken if f"{name}.{t}" in modules]
    return subs if subs and len(subs) == len(taken) else [name] + subs


def circles(graph: dict[str, set[str]]) -> list[list[str]]:
    """The strongly connected components of more than one module (Tarjan's algorithm, iteratively)."""
    index: dict[str, int] = {}
    low: dict[str, int] = {}
    stack: list[str] = []
    on_stack: set[str] = set()
    found: list[list[str]] = []
    for root in sorted(graph):
        if root in index:
            continue
        work = [(root, iter(sorted(graph[root])))]
        index[root] = low[root] = len(index)
        stack.append(root)
        on_stack.add(root)
        while work:
            node, children = work[-1]
            child = next(children, None)
            if child is not None:
                if child not in index:
                    index[child] = low[child] = len(index)
                    stack.append(child)
                    on_stack.add(child)
                    work.append((child, iter(sorted(graph.get(child, ())))))
                elif child in on_stack:
                    low[node] = min(low[node], index[child])
                continue
            work.pop()
            if work:
                low[work[-1][0]] = min(low[work[-1][0]], low[node])
            if low[node] == index[node]:
                component = []
                while True:
                    member = stack.pop()
                    on_stack.discard(member)
                    component.append(member)
                    if member == node:
                        break
                if len(component) > 1:
                    found.append(sorted(component))
    return found


def check(root: Path, known: set[tuple[str, str]] = KNOWN_CIRCLES) -> tuple[list[str], list[str]]:
    """(errors, notes) for the project at `root`, the circles closed by the imports `known` reported as notes."""
    src = root / "src" / "lmkit"
    text = (root / "docs" / "architecture.md").read_text(encoding="utf-8")
    allowed, lazy_only = read_arrows(text)
    allowed_lazy = read_allowed_lazy(text)
    modules = {m.name: m for m in (Module(src, p) for p in sorted(src.rglob("*.py")))}
    errors, notes = [], []
    graph: dict[str, set[str]] = {name: set() for name in modules}
    set_aside: set[tuple[str, str]] = set()  # the allowed and the known imports, kept out of the graph
    for m in modules.values():
        rel = m.path.relative_to(root)
        if m.lines > 400:
            notes.append(f"long module (split it?): {rel}: {m.lines} lines")
        if m.place not in allowed and m.place not in ("lmkit", "__main__"):
            errors.append(f"{rel}: the place {m.place!r} is not in the layer table of docs/architecture.md; add its row")
        may = allowed.get(m.place, set())
        for name, taken, lazy, typing_only in m.imports:
            top = name.split(".")[0]
            if not lazy and top in LAZY_THIRD_PARTY.get(m.place, ()):
                errors.append(f"{rel} imports {top} on import: {m.place}/ may load it only inside a function")
            targets = lmkit_targets(name, taken, modules)
            for target in targets:
                place = target.split(".")[1] if "." in target else "lmkit"
                if place == "cli" and m.place not in ("cli", "__main__"):
                    errors.append(f"{rel} imports {target}: only the command line knows the command line")
                elif place != m.place and "*" not in may and m.place in allowed:
                    if place not in may:
                        errors.append(f"{rel} imports {target}: {m.place} must not depend on {place} "
                                      f"(docs/architecture.md's layer table)")
                    elif place in lazy_only.get(m.place, ()) and not (lazy or typing_only):
                        errors.append(f"{rel} imports {target} on import: {m.place} may import {place} only "
                                      f"inside a function")
                if typing_only or target == m.name:
                    continue
                if (m.name, target) in known or (lazy and (m.name, target) in allowed_lazy):
                    set_aside.add((m.name, target))
                    continue
                graph[m.name].add(target)
    for component in circles(graph):
        members = set(component)
        closing = sorted(f"{a} -> {b}" for a in component for b in graph[a] & members
                         if any(b == t and lz for n, tk, lz, ty in modules[a].imports
                                for t in lmkit_targets(n, tk, modules)))
        errors.append(f"import circle between {', '.join(component)}" +
                      (f"; closed inside a function by {'; '.join(closing)}" if closing else ""))
    for a, b in sorted(known):
        if (a, b) not in set_aside:
            errors.append(f"KNOWN_CIRCLES lists {a} -> {b}, which no longer imports it; remove the entry")
            continue
        graph[a].add(b)
        if any(a in c and b in c for c in circles(graph)):
            notes.append(f"known circle (being broken elsewhere; empty KNOWN_CIRCLES then): {a} -> {b}")
        else:
            errors.append(f"KNOWN_CIRCLES lists {a} -> {b}, which closes no circle any more; remove the entry")
        graph[a].discard(b)
    for a, b in sorted(allowed_lazy):
        if (a, b) not in set_aside:
            errors.append(f"docs/architecture.md allows the function-local import {a} -> {b}, which the code no "
                          f"longer makes; remove its row")
    return errors, notes


def main() -> int:
    root = Path(sys.argv[1] if len(sys.argv) > 1 else Path(__file__).resolve().parents[1])
    if not (root / "src" / "lmkit").is_dir():
        print(f"no src/lmkit under {root}")
        return 2
    errors, notes = check(root)
    for line in notes:
        print(line)
    for line in errors:
        print("layer check:", line)
    if not errors:
        print("layers: every import points the way docs/architecture.md draws, and no import closes a circle"
              + (" but those of KNOWN_CIRCLES" if KNOWN_CIRCLES else ""))
    return 1 if errors else 0


if __name__ == "__main__":
    sys.exit(main())
