"""Rendering chat templates as transformers 5 renders them (jinja2 only; no tokenizer here).

A chat template is a Jinja2 program that turns `messages` into one string. transformers runs it in an
`ImmutableSandboxedEnvironment` (templates come from untrusted folders) with `trim_blocks`, `lstrip_blocks` and
loop controls, a `tojson` that does not escape HTML, `raise_exception(msg)`, `strftime_now(fmt)`, and a
`{% generation %}...{% endgeneration %}` block whose output spans (character offsets into the rendered text)
become the assistant mask. `render_chat` returns the text and those spans.
"""
from __future__ import annotations

import json
import re
from contextlib import contextmanager
from contextvars import ContextVar
from datetime import datetime
from functools import lru_cache

import jinja2
import jinja2.ext
import jinja2.nodes
from jinja2.sandbox import ImmutableSandboxedEnvironment

from lmkit.errors import TokenizerError

CONTINUE_TAG = "CONTINUE_FINAL_MESSAGE_TAG "  # appended to the message to continue, found and cut after rendering
REASONING_FIELDS = ("reasoning_content", "thinking", "reasoning")  # names a message's reasoning goes by
GENERATION_TAG = re.compile(r"\{%-?\s*generation\s*-?%\}")


class ChatTemplateError(TokenizerError):
    """A chat template that fails (its own raise_exception, a syntax error) or inputs it cannot render."""


class _GenerationBlock(jinja2.ext.Extension):
    """`{% generation %}body{% endgeneration %}`: renders body and, while a recording is active, records the
    [start, end) character span body takes in the output."""
    tags = {"generation"}

    def __init__(self, environment):
        super().__init__(environment)
        self._recording: ContextVar = ContextVar("lmkit_generation_spans", default=None)
        environment.extend(record_generation=self.record)

    def parse(self, parser):
        lineno = next(parser.stream).lineno
        body = parser.parse_statements(("name:endgeneration",), drop_needle=True)
        return jinja2.nodes.CallBlock(self.call_method("_span", []), [], [], body).set_lineno(lineno)

    def _span(self, caller):
        text = caller()
        state = self._recording.get()
        if state is not None:
            blocks, spans = state
            start = sum(map(len, blocks))  # the text emitted so far: generate() yields it block by block
            spans.append((start, start + len(text)))
        return text

    @contextmanager
    def record(self, blocks: list[str], spans: list[tuple[int, int]]):
        token = self._recording.set((blocks, spans))
        try:
            yield
        finally:
            self._recording.reset(token)


def _raise_exception(message):
    raise jinja2.exceptions.TemplateError(message)


def _tojson(x, ensure_ascii=False, indent=None, separators=None, sort_keys=False):
    return json.dumps(x, ensure_ascii=ensure_ascii, indent=indent, separators=separators, sort_keys=sort_keys)


def _strftime_now(fmt):
    return datetime.now().strftime(fmt)


class _Dict:
    """`dict(...)` for templates without handing them the type itself (no attribute walk to object)."""

    def __call__(self, *args, **kwargs):
        return dict(*args, **kwargs)

    def fromkeys(self, *args, **kwargs):
        return dict.fromkeys(*args, **kwargs)


class _Namespace(jinja2.utils.Namespace):
    """jinja2's namespace refusing underscore names, so a template cannot reach CPython internals through it."""

    def __init__(*args, **kwargs):
        self, args = args[0], args[1:]
        attrs = dict(*args, **kwargs)
        for name in attrs:
            _Namespace._check(name)
        jinja2.utils.Namespace.__init__(self, attrs)

    def __setitem__(self, name, value):
        _Namespace._check(name)
        jinja2.utils.Namespace.__setitem__(self, name, value)

    @staticmethod
    def _check(name):
        if isinstance(name, str) and name.startswith("_"):
            raise jinja2.exceptions.SecurityError(f"chat templates cannot set underscore attributes ({name!r})")


@lru_cache(maxsize=64)
def compile_template(source: str) -> jinja2.Template:
    """The template compiled in transformers' environment (cached: chats re-render the same few templates)."""
    env = ImmutableSandboxedEnvironment(trim_blocks=True, lstrip_blocks=True,
                                        extensions=[_GenerationBlock, jinja2.ext.loopcontrols])
    env.filters["tojson"] = _tojson
    env.globals.update(raise_exception=_raise_exception, strftime_now=_strftime_now, dict=_Dict(),
                       namespace=_Namespace)
    return env.from_string(source)


def plain(value):
    """`value` rebuilt from JSON types (str, int, float, bool, None, dict, list, tuple); anything else becomes the
    placeholder "<TypeName>", so a template never sees objects with methods of their own."""
    if value is None or type(value) in (str, int, float, bool):
        return value
    if isinstance(value, bool):
        return bool(value)
    if isinstance(value, str):
        return str.__str__(value)
    if isinstance(value, int):
        return int.__int__(value)
    if isinstance(value, float):
        return float.__float__(value)
    if isinstance(value, dict):
        return {plain(k): plain(v) for k, v in value.items()}
    if isinstance(value, list):
        return [plain(v) for v in value]
    if isinstance(value, tuple):
        return tuple(plain(v) for v in value)
    if hasattr(value, "item") and callable(value.item) and type(value).__module__ == "numpy":
        return plain(value.item())
    if callable(getattr(value, "model_dump", None)):
        return plain(value.model_dump())
    return f"<{type(value).__name__}>"


def normalize_messages(conversation) -> list[dict]:
    """Messages as dicts without the keys whose value is None (OpenAI clients send content=None)."""
    messages = getattr(conversation, "messages", conversation)
    out = []
    for m in messages:
        if callable(getattr(m, "model_dump", None)):
            m = m.model_dump()
        if not isinstance(m, dict):
            raise ChatTemplateError(f"chat messages are dicts with 'role' and 'content', not {type(m).__name__}: {m!r}")
        out.append({k: v for k, v in m.items() if v is not None})
    return out


def _alias_reasoning(chat: list[dict]) -> list[dict]:
    """Fill `reasoning_content` (and gpt-oss's `thinking`) from whichever reasoning name a message uses."""
    out = []
    for m in chat:
        reasoning = next((m[k] for k in REASONING_FIELDS if m.get(k) is not None), None)
        out.append({"thinking": reasoning, **m, "reasoning_content": reasoning} if reasoning is not None else m)
    return out


def render_chat(source: str, name: str, chat: list[dict], *, tools=None, documents=None,
                add_generation_prompt: bool = False, continue_final_message: bool | str = False,
                spans: bool = False, **variables) -> tuple[str, list[tuple[int, int]]]:
    """(text, generation spans) of one conversation rendered by the template `source` (called `name` in errors).
    With continue_final_message, the text ends inside the last message, ready to be continued."""
    template = _compile(source, name)
    chat = _alias_reasoning(plain(chat))
    final = None
    if continue_final_message:
        chat, final = _tag_final(chat, source, continue_final_message)
    context = dict(messages=chat, tools=plain(tools), documents=plain(documents),
                   add_generation_prompt=add_generation_prompt, **plain(variables))
    found: list[tuple[int, int]] = []
    try:
        if spans:
            blocks: list[str] = []
            with template.environment.record_generation(blocks, found):
                for block in template.generate(**context):
                    blocks.append(block)
            text = "".join(blocks)
        else:
            text = template.render(**context)
    except jinja2.exceptions.TemplateError as exc:
        raise ChatTemplateError(f"chat template {name!r}: {_one_line(exc)}") from None
    except (TypeError, ValueError, KeyError, AttributeError, IndexError, ArithmeticError) as exc:
        # the template's own code failing on these messages (a dict where it expects a string, ...)
        raise ChatTemplateError(f"chat template {name!r} cannot render these messages "
                                f"({type(exc).__name__}: {_one_line(exc)})") from None
    if final is not None:
        text = _cut_at_tag(text, final, name)
    return text, found


def _compile(source: str, name: str) -> jinja2.Template:
    if not isinstance(source, str):
        raise ChatTemplateError(f"chat template {name!r} must be a string of Jinja, not {type(source).__name__}")
    try:
        return compile_template(source)
    except jinja2.exceptions.TemplateSyntaxError as exc:
        raise ChatTemplateError(f"chat template {name!r} has a syntax error at line {exc.lineno}: {_one_line(exc)}") from None


def _one_line(exc: Exception) -> str:
    return " ".join(str(exc).split()) or type(exc).__name__


def _tag_final(chat: list[dict], source: str, field: bool | str) -> tuple[list[dict], str]:
    """Append CONTINUE_TAG to the final message's `field` (content by default), so the rendered text can be cut
    right after it; returns the chat and the message's original text."""
    if not chat:
        raise ChatTemplateError("continue_final_message needs a conversation with at least one message")
    field = field if isinstance(field, str) else "content"
    last = chat[-1]
    final = last.get(field)
    if final is None:
        raise ChatTemplateError(f"continue_final_message: the final message has no {field!r} to continue")
    fields = [f for f in REASONING_FIELDS if last.get(f) == final] if field in REASONING_FIELDS else [field]
    if not any(f in source for f in fields):
        raise ChatTemplateError(f"continue_final_message={field!r}, but the chat template never reads that field")
    if isinstance(final, (list, tuple)):
        for block in reversed(final):
            if isinstance(block, dict) and "text" in block:
                final = block["text"]
                block["text"] = block["text"] + CONTINUE_TAG
                break
        else:
            raise ChatTemplateError("continue_final_message: the final message has no text block to continue")
    else:
        for f in fields:
            last[f] = last[f] + CONTINUE_TAG
    return chat, final


def _cut_at_tag(text: str, final: str, name: str) -> str:
    tag = CONTINUE_TAG.strip()
    if final.strip() not in text or tag not in text:
        raise ChatTemplateError(f"chat template {name!r} drops part of the final message, so it cannot be continued "
                                "(continue_final_message); end the conversation on a message it renders whole")
    at = text.rindex(tag)
    return text[:at] if text[at:at + len(CONTINUE_TAG)] == CONTINUE_TAG else text[:at].rstrip()
