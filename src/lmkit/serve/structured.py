"""Structured outputs in a request: OpenAI's `response_format` (json_object, json_schema) and vLLM's extensions
(`structured_outputs` {json, regex, choice, grammar, json_object, disable_any_whitespace} and the older
`guided_json`, `guided_regex`, `guided_choice`, `guided_grammar`), read into one `Grammar` and compiled once per
grammar for the served tokenizer; a grammar that does not compile is a 400 naming the field and xgrammar's reason."""
from __future__ import annotations

from typing import Any, NamedTuple

from lmkit.errors import GenerationError
from lmkit.generation.grammar import Grammar, compiler_for
from lmkit.serve.protocol import APIError

STRUCTURED_FIELDS = {"response_format", "structured_outputs", "guided_json", "guided_regex", "guided_choice",
                     "guided_grammar", "guided_decoding_backend", "guided_whitespace_pattern"}
GUIDED = {"guided_json": "json_schema", "guided_regex": "regex", "guided_choice": "choice", "guided_grammar": "grammar"}
OUTPUTS = {"json": "json_schema", "regex": "regex", "choice": "choice", "grammar": "grammar",
           "json_object": "json_object"}
BACKENDS = (None, "auto", "xgrammar")


def _bad(param: str, message: str) -> APIError:
    return APIError(400, f"{param}: {message}", param=param, code="invalid_value")


def _response_format(value) -> Grammar | None:
    kind = value.get("type") if isinstance(value, dict) else None
    if kind not in ("text", "json_object", "json_schema"):
        raise _bad("response_format", f"must be {{\"type\": \"text\" | \"json_object\" | \"json_schema\", ...}}, "
                                      f"got {value!r}")
    if kind == "text":
        return None
    if kind == "json_object":
        return Grammar("json_object")
    spec = value.get("json_schema")
    if not isinstance(spec, dict) or not isinstance(spec.get("schema"), (dict, bool)):
        raise _bad("response_format", "json_schema needs {\"name\": ..., \"schema\": {a JSON schema}}")
    return Grammar("json_schema", spec["schema"])


def parse_structured(body: dict) -> tuple[str, Grammar] | None:
    """(the field that gave it, the Grammar) of a request, or None; more than one constraint is a 400."""
    found: list[tuple[str, Grammar]] = []
    if body.get("response_format") is not None:
        grammar = _response_format(body["response_format"])
        if grammar is not None:
            found.append(("response_format", grammar))
    for name, kind in GUIDED.items():
        if body.get(name) is not None:
            found.append((name, Grammar(kind, body[name])))
    space = True
    outputs = body.get("structured_outputs")
    if outputs is not None:
        if not isinstance(outputs, dict) or set(outputs) - set(OUTPUTS) - {"disable_any_whitespace"}:
            raise _bad("structured_outputs", f"takes {', '.join(OUTPUTS)} (one of them) and disable_any_whitespace; "
                                             f"got {outputs!r}")
        space = not outputs.get("disable_any_whitespace", False)
        for key, kind in OUTPUTS.items():
            if outputs.get(key) is not None and not (key == "json_object" and outputs[key] is False):
                found.append(("structured_outputs", Grammar(kind, None if kind == "json_object" else outputs[key])))
    if body.get("guided_decoding_backend") not in BACKENDS:
        raise _bad("guided_decoding_backend", f"this server's grammar engine is xgrammar; got "
                                              f"{body['guided_decoding_backend']!r}")
    if body.get("guided_whitespace_pattern") is not None:
        raise _bad("guided_whitespace_pattern", "is not supported; structured_outputs.disable_any_whitespace: true "
                                                "allows only the single spaces of \", \" and \": \"")
    if len(found) > 1:
        raise _bad(found[1][0], f"only one structured output constraint may be given; got {found[0][0]} and "
                                f"{found[1][0]}")
    if not found:
        return None
    param, grammar = found[0]
    return param, Grammar(grammar.kind, grammar.value, any_whitespace=space)


def compile_structured(server, body: dict):
    """The compiled grammar of the request (None: unconstrained); a 400 when it does not compile."""
    parsed = parse_structured(body)
    if parsed is None:
        return None
    return compile_grammar(server, *parsed)


class Compiled(NamedTuple):
    """A grammar compiled for the served tokenizer, and the Grammar it came from (an engine process compiles it
    again on its side)."""

    compiled: Any
    grammar: Grammar


def compile_grammar(server, param: str, grammar: Grammar) -> Compiled:
    """`grammar` compiled for the served tokenizer; a 400 naming `param` when it does not compile."""
    try:
        return Compiled(compiler_for(server.tokenizer, server.model.config.vocab_size).compile(grammar), grammar)
    except GenerationError as exc:
        raise APIError(400, f"{param}: {exc}", param=param, code="invalid_grammar") from None


def warm_grammars(server) -> None:
    """Make the served tokenizer's grammar compiler now (importing xgrammar and reading the vocabulary take seconds),
    so that the first structured request does not wait for it; without xgrammar, nothing (that request says so)."""
    try:
        compiler_for(server.tokenizer, server.model.config.vocab_size)
    except ImportError:
        pass
