"""Structured outputs: a JSON schema, any JSON object, a regular expression, a list of choices or an EBNF grammar,
compiled by xgrammar (the grammar engine vLLM and SGLang use) into the set of tokens allowed next; `GrammarConstraint`
is the logits processor that sets every other token's score to -inf, row by row.

Each row's matcher follows its own output: before masking a step it accepts the tokens the row chose since the last
one, so the constraint works in any decoding loop that calls the processor list (generate, the serving engine's
per-row step). Once the grammar is complete only the row's end tokens stay allowed, so the row stops there.

Whitespace: between JSON elements at most `MAX_WHITESPACE` whitespace characters per gap (any JSON whitespace), or,
with `any_whitespace=False` (vLLM's disable_any_whitespace), exactly the one space of ", " and ": ". Every gap is
followed by a required element, so a model that prefers whitespace cannot loop on it forever.
"""
from __future__ import annotations

import json
import re
import threading
import weakref
from dataclasses import dataclass
from typing import Any

import torch

from lmkit.errors import GenerationError
from lmkit.generation.processors import LogitsProcessor

KINDS = ("json_schema", "json_object", "regex", "choice", "grammar")
MAX_WHITESPACE = 4


@dataclass(frozen=True)
class Grammar:
    """What the output must match: `kind` one of KINDS; `value` the schema (a dict or its JSON text), the regex, the
    choices (strings), the EBNF text (root rule `root`), or None for json_object."""

    kind: str
    value: Any = None
    any_whitespace: bool = True

    @classmethod
    def parse(cls, spec) -> "Grammar":
        """A Grammar, or {kind: value} with one of KINDS (json_object's value: True)."""
        if isinstance(spec, Grammar):
            return spec
        if not isinstance(spec, dict) or len(spec) != 1 or next(iter(spec)) not in KINDS:
            raise GenerationError(f"grammar must be a Grammar or one {{kind: value}} with a kind among "
                                  f"{', '.join(KINDS)}, e.g. {{'json_schema': {{'type': 'object'}}}}; got {spec!r}")
        kind, value = next(iter(spec.items()))
        return cls(kind, None if kind == "json_object" else value)

    def key(self) -> str:
        return json.dumps([self.kind, self.value, self.any_whitespace], sort_keys=True, ensure_ascii=False)


def _xgrammar():
    from lmkit.extras import require

    return require("xgrammar", "structured outputs")


def _tokenizer_info(xgr, tokenizer, vocab_size: int):
    """xgrammar's view of the vocabulary (an lmkit or a transformers tokenizer); special tokens other than byte pieces
    get no text, so that a grammar never spells them (a chat's end-of-turn inside a JSON string would end the turn)."""
    backend = getattr(tokenizer, "backend_tokenizer", tokenizer)  # transformers' fast tokenizer wraps `tokenizers`
    meta = xgr.TokenizerInfo._detect_metadata_from_hf(backend.to_str())
    token = getattr(tokenizer, "convert_ids_to_tokens", None) or tokenizer.id_to_token
    size = min(len(tokenizer), vocab_size)
    special = {i for i in getattr(tokenizer, "all_special_ids", None) or []
               if i < size and not re.fullmatch(r"<0x[0-9A-Fa-f]{2}>", token(i) or "")}
    vocab = ["" if i in special else (token(i) or "") for i in range(size)]
    return xgr.TokenizerInfo(vocab, meta["vocab_type"], vocab_size=vocab_size, stop_token_ids=[],
                             add_prefix_space=meta["add_prefix_space"])


class GrammarCompiler:
    """Compiles `Grammar`s for one tokenizer and vocabulary size; each grammar is compiled once and kept."""

    LIMIT = 256  # compiled grammars kept (least recently used first out)

    def __init__(self, tokenizer, vocab_size: int):
        self.xgr = _xgrammar()
        self.vocab_size = vocab_size
        self.compiler = self.xgr.GrammarCompiler(_tokenizer_info(self.xgr, tokenizer, vocab_size), max_threads=1,
                                                 cache_enabled=False)
        self.compiled: dict[str, Any] = {}
        self.lock = threading.Lock()

    def compile(self, grammar: Grammar):
        key = grammar.key()
        with self.lock:
            hit = self.compiled.pop(key, None)
            if hit is not None:
                self.compiled[key] = hit
                return hit
        compiled = self._compile(grammar)
        with self.lock:
            self.compiled[key] = compiled
            while len(self.compiled) > self.LIMIT:
                self.compiled.pop(next(iter(self.compiled)))
        return compiled

    def _compile(self, grammar: Grammar):
        kind, value = grammar.kind, grammar.value
        space = {"any_whitespace": grammar.any_whitespace,
                 "max_whitespace_cnt": MAX_WHITESPACE if grammar.any_whitespace else None}
        try:
            if kind == "json_object":
                return self.compiler.compile_json_schema('{"type": "object"}', strict_mode=False, **space)
            if kind == "json_schema":
                if not isinstance(value, (dict, bool, str)):
                    raise GenerationError(f"a JSON schema is an object (or its JSON text), got {value!r}")
                text = json.dumps(_json_strings(json.loads(value) if isinstance(value, str) else value))
                return self.compiler.compile_json_schema(text, strict_mode=True, **space)
            if kind == "regex":
                if not isinstance(value, str) or not value:
                    raise GenerationError(f"a regex is a non-empty string, got {value!r}")
                return self.compiler.compile_regex(value)
            if kind == "choice":
                if not isinstance(value, (list, tuple)) or not value or any(not isinstance(c, str) or not c
                                                                            for c in value):
                    raise GenerationError(f"choices are a non-empty list of non-empty strings, got {value!r}")
                alternatives = " | ".join(json.dumps(c, ensure_ascii=False) for c in dict.fromkeys(value))
                return self.compiler.compile_grammar(f"root ::= {alternatives}")
            if kind == "grammar":
                if not isinstance(value, str) or not value.strip():
                    raise GenerationError(f"a grammar is EBNF text with a rule named root, got {value!r}")
                return self.compiler.compile_grammar(value)
        except json.JSONDecodeError as exc:
            raise GenerationError(f"the JSON schema is not JSON: {exc}") from None
        except (RuntimeError, ValueError, TypeError) as exc:  # xgrammar's parse errors
            if isinstance(exc, GenerationError):
                raise
            raise GenerationError(f"the {kind.replace('_', ' ')} cannot be compiled: {_reason(exc)}") from None
        raise GenerationError(f"unknown grammar kind {kind!r}; use one of {', '.join(KINDS)}")


# one character of a JSON string: any but '"', '\\' and the controls, or an escape
_CHAR = r'([^"\\\x00-\x1f]|\\(["\\/bfnrt]|u[0-9A-Fa-f]{4}))'


def _json_strings(schema):
    """The schema with each length-bounded plain string given as the pattern of its characters: xgrammar 0.2.8 lets
    the characters of a string with minLength/maxLength include raw control characters, which JSON does not allow."""
    if isinstance(schema, list):
        return [_json_strings(s) for s in schema]
    if not isinstance(schema, dict):
        return schema
    out = {k: _json_strings(v) for k, v in schema.items()}
    if out.get("type") == "string" and ({"minLength", "maxLength"} & set(out)) \
            and not ({"pattern", "format", "enum", "const"} & set(out)):
        low, high = out.pop("minLength", 0), out.pop("maxLength", "")
        out["pattern"] = f"^{_CHAR}{{{low},{high}}}$"
    return out


def _reason(exc: Exception) -> str:
    """xgrammar's message without its C++ source location."""
    lines = [line for line in str(exc).strip().splitlines() if line.strip()]
    text = lines[-1] if lines else type(exc).__name__
    return text.split(": ", 1)[1] if text.startswith("[") and ": " in text else text


_COMPILERS: "weakref.WeakKeyDictionary" = weakref.WeakKeyDictionary()
_COMPILERS_LOCK = threading.Lock()


def compiler_for(tokenizer, vocab_size: int) -> GrammarCompiler:
    """The tokenizer's compiler for a model of `vocab_size` logits (made once per tokenizer)."""
    with _COMPILERS_LOCK:
        by_size = _COMPILERS.setdefault(tokenizer, {})
        if vocab_size not in by_size:
            by_size[vocab_size] = GrammarCompiler(tokenizer, vocab_size)
        return by_size[vocab_size]


class GrammarConstraint(LogitsProcessor):
    """Scores of the tokens a row's grammar does not allow next set to -inf (see the module docstring). `start`: the
    sequences' length before the first new token; `eos`: the tokens a row may end with once its grammar is done."""

    def __init__(self, compiled, rows: int, start: int, eos: list[int], matchers: list | None = None,
                 fed: list[int] | None = None, grammar: Grammar | None = None):
        """`grammar`: the Grammar `compiled` came from (kept so that another process can compile it again)."""
        if not eos:
            raise GenerationError("a grammar needs an end token to stop at once it is complete; give eos_token_id "
                                  "(and do not combine it with ignore_eos)")
        self.xgr, self.compiled, self.start, self.eos = _xgrammar(), compiled, start, list(eos)
        self.matchers = matchers if matchers is not None else [
            self.xgr.GrammarMatcher(compiled, override_stop_tokens=self.eos) for _ in range(rows)]
        self.fed = fed if fed is not None else [0] * rows  # output tokens each matcher has accepted
        self.grammar = grammar

    @classmethod
    def build(cls, tokenizer, vocab_size: int, grammar, rows: int, start: int, eos: list[int]) -> "GrammarConstraint":
        """Compile `grammar` (a Grammar or {kind: value}) for the tokenizer and constrain `rows` rows."""
        compiled = compiler_for(tokenizer, vocab_size).compile(Grammar.parse(grammar))
        return cls(compiled, rows, start, eos, grammar=Grammar.parse(grammar))

    def __call__(self, input_ids: torch.Tensor, scores: torch.Tensor) -> torch.Tensor:
        mask = self.xgr.allocate_token_bitmask(scores.shape[0], scores.shape[-1])
        for row, matcher in enumerate(self.matchers):
            new = input_ids[row, self.start + self.fed[row]:].tolist()
            for token in new:
                if not matcher.is_terminated():
                    matcher.accept_token(token)
            self.fed[row] += len(new)
            if not matcher.is_terminated():  # a finished row (padded on by generate) keeps every token
                matcher.fill_next_token_bitmask(mask, row)
        scores = scores.clone()  # the caller may still read its raw logits (log-probabilities)
        self.xgr.apply_token_bitmask_inplace(scores, mask.to(scores.device))
        return scores

    def done(self, row: int = 0) -> bool:
        """Whether row `row`'s grammar has been completed (its end token accepted)."""
        return self.matchers[row].is_terminated()

    def select(self, index: torch.Tensor) -> "GrammarConstraint":
        rows = index.tolist()
        return GrammarConstraint(self.compiled, len(rows), self.start, self.eos,
                                 [self.matchers[i].fork() for i in rows], [self.fed[i] for i in rows], self.grammar)
