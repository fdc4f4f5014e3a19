"""Tools given to a chat template as Python functions: the JSON schema transformers' `get_json_schema` builds.

    {"type": "function", "function": {"name", "description", "parameters": {"type": "object", "properties",
     "required"}, "return"?}}

from the signature (type hints: int, float, str, bool, None, Any, list/tuple/dict and their parameters, Union and
Optional, Literal, Enum) and a Google-style docstring (the summary, an `Args:` entry per argument with an optional
trailing `(choices: [...])`, an optional `Returns:`). Key order follows transformers', since templates print the
schema with `tojson`.
"""
from __future__ import annotations

import enum
import inspect
import json
import re
import types
import typing

from lmkit.tokenizers.chat_render import ChatTemplateError


class ToolSchemaError(ChatTemplateError):
    """A function that cannot become a tool schema: no docstring, an undescribed argument, an unknown type hint."""


SCALARS = {int: "integer", float: "number", str: "string", bool: "boolean", type(None): "null"}
PLAIN = {**{t: {"type": name} for t, name in SCALARS.items()}, list: {"type": "array"}, tuple: {"type": "array"},
         dict: {"type": "object"}}
# tensor-like hints named by module and class, so this layer needs neither torch nor PIL imported
NAMED = {("torch", "Tensor"): {"type": "audio"}, ("PIL.Image", "Image"): {"type": "image"}}

SECTION = r"(?:Args:|Returns:|Raises:|\Z)"
SUMMARY = re.compile(r"^(.*?)\s*" + SECTION, re.DOTALL)             # the text before the first section word
ARGS = re.compile(r"\n\s*Args:\n(.*?)\s*(?:Returns:|Raises:|\Z)", re.DOTALL)
RETURNS = re.compile(r"\n\s*Returns:\n\s*(.*?)\s*(?:Raises:|\Z)", re.DOTALL)
ENTRY = re.compile(r"^([ \t]*)(\w+)(?:[ \t]*\([^()\n]*\))?:")      # "name:" or "name (type):" opening an argument
CHOICES = re.compile(r"\(choices:\s*(.*?)\)\s*$", re.IGNORECASE)


def _enum_schema(values: list) -> dict:
    kinds = list(dict.fromkeys(SCALARS[type(v)] for v in values))  # each JSON type once, first seen first
    return {"type": kinds[0] if len(kinds) == 1 else kinds, "enum": values}


def hint_schema(hint) -> dict:
    """The JSON schema of one type hint."""
    origin, args = typing.get_origin(hint), typing.get_args(hint)
    if origin is None:
        if isinstance(hint, type) and issubclass(hint, enum.Enum):
            values = [m.value for m in hint]
            if not values:
                raise ToolSchemaError(f"the Enum {hint.__name__} has no members; give it at least one")
            if any(type(v) not in SCALARS for v in values):
                raise ToolSchemaError(f"the Enum {hint.__name__} has values that are not JSON scalars ({values}); "
                                      "use int, float, str, bool or None values")
            return _enum_schema(values)
        if hint is typing.Any:
            return {}
        if hint in PLAIN:
            return dict(PLAIN[hint])
        named = NAMED.get((getattr(hint, "__module__", None), getattr(hint, "__name__", None)))
        if named is not None and isinstance(hint, type):
            return dict(named)
        raise ToolSchemaError(f"cannot write the type hint {hint!r} as JSON schema; use int, float, str, bool, an "
                              "Enum, Literal, or list/tuple/dict/Union of those, or pass a JSON schema for this tool")
    if origin is typing.Union or origin is types.UnionType:
        parts = [hint_schema(a) for a in args if a is not type(None)]
        if len(parts) == 1:
            out = parts[0]
        elif all(p.keys() == {"type"} and isinstance(p["type"], str) for p in parts):
            names = sorted({p["type"] for p in parts})
            out = {"type": names[0] if len(names) == 1 else names}
        else:
            out = {"anyOf": parts}  # members with items/enum/... keep them
        if type(None) in args:
            out["nullable"] = True
        return out
    if origin is typing.Literal and args:
        if any(type(a) not in SCALARS for a in args):
            raise ToolSchemaError(f"Literal{list(args)} holds values that are not JSON scalars; use int, float, str, "
                                  "bool or None")
        return _enum_schema(list(args))
    if origin is list:
        return {"type": "array", "items": hint_schema(args[0])} if args else {"type": "array"}
    if origin is tuple:
        if not args:
            return {"type": "array"}
        if len(args) == 1:
            raise ToolSchemaError(f"the one-element tuple hint {hint} has no JSON schema; use list[...] or the "
                                  "element's own type")
        if ... in args:
            raise ToolSchemaError(f"the tuple hint {hint} has '...'; use list[...] for inputs of any length")
        return {"type": "array", "prefixItems": [hint_schema(a) for a in args]}
    if origin is dict:
        out = {"type": "object"}
        if len(args) == 2:
            out["additionalProperties"] = hint_schema(args[1])
        return out
    raise ToolSchemaError(f"cannot write the type hint {hint!r} as JSON schema; use int, float, str, bool, an Enum, "
                          "Literal, or list/tuple/dict/Union of those, or pass a JSON schema for this tool")


def parse_docstring(doc: str) -> tuple[str | None, dict[str, str], str | None]:
    """(summary, {argument: description}, returns) of a Google-style docstring."""
    summary = SUMMARY.search(doc)
    args = ARGS.search(doc)
    returns = RETURNS.search(doc)
    described: dict[str, str] = {}
    if args:
        lines = [line for line in args.group(1).split("\n") if line.strip()]
        entry = None  # (indent, name, description lines) of the argument being read
        for line in lines:
            opened = ENTRY.match(line)
            # a "name:" line opens the next argument unless it is indented deeper than the current one
            if opened and (entry is None or not (opened.group(1).startswith(entry[0]) and
                                                 line[len(entry[0]):len(entry[0]) + 1] in (" ", "\t"))):
                if entry is not None:
                    described[entry[1]] = _one_line(entry[2])
                entry = (opened.group(1), opened.group(2), [line[opened.end():]])
            elif entry is not None:
                entry[2].append(line)
        if entry is not None:
            described[entry[1]] = _one_line(entry[2])
    return (summary.group(1).strip() if summary else None, described,
            returns.group(1).strip() if returns else None)


def _one_line(lines: list[str]) -> str:
    return re.sub(r"\s*\n+\s*", " ", "\n".join(lines).strip())


def get_json_schema(func) -> dict:
    """The tool schema of `func` (see the module doc); ToolSchemaError when its docstring or hints fall short."""
    name = getattr(func, "__name__", "operation")
    doc = inspect.getdoc(func)
    if not doc:
        raise ToolSchemaError(f"the tool {name} has no docstring; write one with a summary and an Args: entry per "
                              "argument (Google style)")
    summary, described, returns = parse_docstring(doc.strip())
    hints = typing.get_type_hints(func)
    params = inspect.signature(func).parameters
    first = next(iter(params), None)
    receiver = first if first in ("self", "cls") and params[first].annotation is inspect.Parameter.empty else None
    required = []
    for p in params.values():
        if p.name == receiver:
            continue
        if p.annotation is inspect.Parameter.empty:
            raise ToolSchemaError(f"argument {p.name} of the tool {name} has no type hint; annotate it")
        if p.default is inspect.Parameter.empty:
            required.append(p.name)
    properties, returned = {}, None
    for arg, hint in hints.items():
        if arg == receiver:
            continue
        if arg == "return":
            try:  # the model never writes the return value: an unknown return hint is left out, not an error
                returned = hint_schema(hint)
            except ToolSchemaError:
                pass
            continue
        properties[arg] = hint_schema(hint)
    for arg, schema in properties.items():
        if arg not in described:
            raise ToolSchemaError(f"the docstring of the tool {name} does not describe its argument {arg!r}; add "
                                  f"'{arg}: ...' under Args:")
        text = described[arg]
        choices = CHOICES.search(text)
        if choices:
            try:
                values = json.loads(choices.group(1))
            except ValueError:
                raise ToolSchemaError(f"the choices of {arg!r} in the tool {name} are not a JSON list "
                                      f"({choices.group(1)!r}); write them as (choices: [\"a\", \"b\"])") from None
            schema["enum"] = [v.strip() if isinstance(v, str) else v for v in values]
            text = text[:choices.start()].strip()
        schema["description"] = text
    if returned is not None and returns is not None:
        returned["description"] = returns
    parameters = {"type": "object", "properties": properties, **({"required": required} if required else {})}
    function = {"name": name, "description": summary, "parameters": parameters}
    if returned is not None:
        function["return"] = returned
    return {"type": "function", "function": function}


def tool_schemas(tools) -> list[dict] | None:
    """Tools as the JSON schemas templates read: dicts as given, functions and methods through get_json_schema."""
    if tools is None:
        return None
    out = []
    for tool in tools:
        if isinstance(tool, dict):
            out.append(tool)
        elif inspect.isfunction(tool) or inspect.ismethod(tool):
            out.append(get_json_schema(tool))
        else:
            raise ToolSchemaError(f"a tool is a JSON schema (dict) or a function with type hints and a docstring, "
                                  f"not {type(tool).__name__}")
    return out
