"""Tool calls on /v1/chat/completions: `tools` and `tool_choice` checked, the model's tool-call text parsed into
OpenAI's `tool_calls`, and the calls `tool_choice` forces written as a grammar.

The formats, as the chat templates TRL ships (and Mistral's) ask the model to write them, chosen from the folder's
template (`tool_format`):
- "hermes" (Qwen 2.5/3, Hermes): `<tool_call>\\n{"name": ..., "arguments": {...}}\\n</tool_call>`, one block per call,
  after any text;
- "llama3_json" (Llama 3.1/3.2): the whole reply one `{"name": ..., "parameters": {...}}` (after an optional
  `<|python_tag|>`), or several joined by ";";
- "mistral": `[TOOL_CALLS]` then a JSON list of `{"name": ..., "arguments": {...}}`.
A reply in none of them, or one that does not parse or names no given tool, is content (finish_reason "stop"), as
vLLM returns it. `tool_choice` "required" or a named function is decoded under a JSON grammar, as vLLM does: a list of
{"name", "parameters"} objects, or the named function's arguments alone, whatever the template's format.
"""
from __future__ import annotations

import json
import re
import uuid
from dataclasses import dataclass

from lmkit.generation.grammar import Grammar
from lmkit.serve.protocol import APIError

FORMATS = ("hermes", "llama3_json", "mistral")
HERMES = re.compile(r"<tool_call>\s*(.*?)\s*(?:</tool_call>|$)", re.DOTALL)


def _bad(param: str, message: str) -> APIError:
    return APIError(400, f"{param}: {message}", param=param, code="invalid_value")


@dataclass
class ToolMode:
    """What a chat request asks of tools: the functions by name, and "auto", "required" or one function's name."""

    functions: dict[str, dict]  # name -> {"name", "description"?, "parameters"?}
    choice: str  # "auto" | "required" | "named"
    named: str | None = None
    format: str = "hermes"
    parallel: bool = True  # parallel_tool_calls: false makes "required" one call

    @property
    def forced(self) -> bool:
        return self.choice in ("required", "named")

    def grammar(self) -> Grammar | None:
        """The JSON grammar of a forced call (None for "auto")."""
        if self.choice == "named":
            return Grammar("json_schema", _parameters(self.functions[self.named]))
        if self.choice != "required":
            return None
        calls = [{"type": "object", "properties": {"name": {"enum": [name]}, "parameters": _parameters(f)},
                  "required": ["name", "parameters"]} for name, f in self.functions.items()]
        bounds = {"minItems": 1} if self.parallel else {"minItems": 1, "maxItems": 1}
        return Grammar("json_schema", {"type": "array", **bounds, "items": {"anyOf": calls}})

    def calls(self, text: str) -> tuple[str | None, list[dict]] | None:
        """(content, tool_calls) of a finished reply, or None when it holds no call that parses."""
        content = None
        if self.choice == "named":
            found = [(self.named, _loads(text))]
        elif self.choice == "required":
            items = _loads(text)
            found = [(c.get("name"), c.get("parameters")) for c in items if isinstance(c, dict)] \
                if isinstance(items, list) else []
        else:
            parsed = parse_calls(text, self.format)
            if parsed is None:
                return None
            content, found = parsed
        if not found or any(name not in self.functions or not isinstance(args, dict) for name, args in found):
            return None
        return content, [tool_call(name, args) for name, args in found]

    def may_start(self, text: str) -> bool:
        """Whether `text` (the reply so far, special tokens kept) could be, or already holds, a tool call: streamed
        content waits while it is (and goes on once the text can no longer begin one)."""
        if self.forced:
            return True
        stripped = text.lstrip()
        markers = {"hermes": ["<tool_call>"], "mistral": ["[TOOL_CALLS]"],
                   "llama3_json": ["<|python_tag|>", "{"]}[self.format]
        if self.format == "hermes":
            return "<tool_call>" in text or any(text.endswith(m[:k]) for m in markers for k in range(1, len(m)))
        return any(stripped.startswith(m) or m.startswith(stripped) for m in markers) if stripped else True


def _parameters(function: dict) -> dict:
    params = function.get("parameters")
    return params if isinstance(params, dict) and params else {"type": "object", "properties": {}}


def _loads(text: str):
    try:
        return json.loads(text)
    except (json.JSONDecodeError, TypeError):
        return None


def tool_call(name: str, arguments: dict) -> dict:
    return {"id": "call_" + uuid.uuid4().hex[:24], "type": "function",
            "function": {"name": name, "arguments": json.dumps(arguments, ensure_ascii=False)}}


def parse_calls(text: str, fmt: str) -> tuple[str | None, list[tuple[str, dict]]] | None:
    """(content before the calls or None, [(name, arguments)]) of a reply in format `fmt`, or None."""
    if fmt == "hermes":
        if "<tool_call>" not in text:
            return None
        blocks = [_loads(b) for b in HERMES.findall(text)]
        calls = [(b.get("name"), b.get("arguments", b.get("parameters"))) for b in blocks if isinstance(b, dict)]
        if len(calls) != len(blocks):
            return None
        content = text[:text.index("<tool_call>")].strip() or None
        return content, calls
    if fmt == "mistral":
        if "[TOOL_CALLS]" not in text:
            return None
        before, after = text.split("[TOOL_CALLS]", 1)
        items = _loads(after.strip())
        items = [items] if isinstance(items, dict) else items
        if not isinstance(items, list) or not all(isinstance(i, dict) for i in items):
            return None
        return before.strip() or None, [(i.get("name"), i.get("arguments", i.get("parameters"))) for i in items]
    body = text.strip().removeprefix("<|python_tag|>").strip()
    parts = [_loads(p) for p in body.split(";")] if body.startswith("{") else [None]
    if not all(isinstance(p, dict) and "name" in p for p in parts):
        return None
    return None, [(p["name"], p.get("parameters", p.get("arguments"))) for p in parts]


def tool_format(template) -> str:
    """The tool-call format a chat template asks for (hermes when it names none)."""
    text = json.dumps(template) if not isinstance(template, str) else template
    if "[TOOL_CALLS]" in text:
        return "mistral"
    if "<tool_call>" in text:
        return "hermes"
    if "<|python_tag|>" in text or ('"parameters": ' in text and "<|eot_id|>" in text):
        return "llama3_json"
    return "hermes"


def parse_tools(body: dict, template) -> ToolMode | None:
    """The request's ToolMode (None: no tools, or tool_choice "none"); bad tools or tool_choice are a 400."""
    tools, choice = body.get("tools"), body.get("tool_choice")
    if tools is None:
        if choice not in (None, "none"):
            raise _bad("tool_choice", "needs tools")
        return None
    if not isinstance(tools, list) or not tools:
        raise _bad("tools", "must be a non-empty list of {\"type\": \"function\", \"function\": {\"name\", ...}}")
    functions = {}
    for tool in tools:
        function = tool.get("function") if isinstance(tool, dict) and tool.get("type") == "function" else None
        if not isinstance(function, dict) or not isinstance(function.get("name"), str) or not function["name"]:
            raise _bad("tools", f"each tool is {{\"type\": \"function\", \"function\": {{\"name\", \"description\", "
                                f"\"parameters\"}}}}, got {tool!r}")
        if function.get("parameters") is not None and not isinstance(function["parameters"], dict):
            raise _bad("tools", f"{function['name']}: parameters must be a JSON schema object")
        functions[function["name"]] = function
    if choice is None or choice == "auto":
        return ToolMode(functions, "auto", format=tool_format(template))
    if choice == "none":
        return None
    if body.get("parallel_tool_calls") not in (None, True, False):
        raise _bad("parallel_tool_calls", "must be true or false")
    if choice == "required":
        return ToolMode(functions, "required", parallel=body.get("parallel_tool_calls") is not False)
    name = (choice.get("function") or {}).get("name") if isinstance(choice, dict) else None
    if not isinstance(choice, dict) or choice.get("type") != "function" or not isinstance(name, str):
        raise _bad("tool_choice", f"must be \"none\", \"auto\", \"required\" or {{\"type\": \"function\", \"function\": "
                                  f"{{\"name\": ...}}}}, got {choice!r}")
    if name not in functions:
        raise _bad("tool_choice", f"names the function {name!r}, which is not among tools ({', '.join(functions)})")
    return ToolMode(functions, "named", named=name)


def template_messages(messages: list[dict]) -> list[dict]:
    """Messages as chat templates read them: an assistant's tool call arguments as objects (OpenAI sends JSON text)."""
    out = []
    for message in messages:
        calls = message.get("tool_calls")
        if message.get("role") == "assistant" and isinstance(calls, list):
            fixed = []
            for call in calls:
                function = dict(call.get("function") or {}) if isinstance(call, dict) else {}
                if isinstance(function.get("arguments"), str):
                    function["arguments"] = _loads(function["arguments"]) or {}
                fixed.append({**call, "function": function} if isinstance(call, dict) else call)
            message = {**message, "tool_calls": fixed}
        out.append(message)
    return out


def fragments(arguments: str, size: int = 8) -> list[str]:
    """The arguments' JSON text in pieces, as OpenAI streams them."""
    return [arguments[i:i + size] for i in range(0, len(arguments), size)] or [""]
