"""The tool-call parsers on replies as each format writes them (several calls, text before a Hermes call, Llama 3's
";"-joined calls, Mistral's list), malformed replies refused, and the format read from TRL's templates."""
import json
from pathlib import Path

import pytest

from lmkit.serve.tools import ToolMode, parse_calls, tool_format

FUNCTIONS = {"f": {"name": "f"}, "g": {"name": "g"}}


@pytest.mark.parametrize("fmt, text, expected", [
    ("hermes", 'Sure.\n<tool_call>\n{"name": "f", "arguments": {"a": 1}}\n</tool_call>\n<tool_call>\n'
               '{"name": "g", "arguments": {}}\n</tool_call>', ("Sure.", [("f", {"a": 1}), ("g", {})])),
    ("hermes", '<tool_call>{"name": "f", "arguments": {"s": "é"}}', (None, [("f", {"s": "é"})])),
    ("llama3_json", '<|python_tag|>{"name": "f", "parameters": {"a": 2}}; {"name": "g", "parameters": {}}',
     (None, [("f", {"a": 2}), ("g", {})])),
    ("mistral", '[TOOL_CALLS][{"name": "f", "arguments": {"a": 3}}]', (None, [("f", {"a": 3})])),
    ("hermes", "no call here", None), ("hermes", "<tool_call>\n{broken\n</tool_call>", None),
    ("llama3_json", "{not json}", None), ("llama3_json", "plain text", None), ("mistral", "[TOOL_CALLS] nope", None),
])
def test_parse_calls(fmt, text, expected):
    assert parse_calls(text, fmt) == expected


def test_calls_refuse_unknown_functions_and_non_object_arguments():
    auto = ToolMode(FUNCTIONS, "auto", format="hermes")
    content, calls = auto.calls('<tool_call>{"name": "f", "arguments": {"a": 1}}</tool_call>')
    assert content is None and calls[0]["function"] == {"name": "f", "arguments": json.dumps({"a": 1})}
    assert auto.calls('<tool_call>{"name": "h", "arguments": {}}</tool_call>') is None
    assert auto.calls('<tool_call>{"name": "f", "arguments": [1]}</tool_call>') is None
    required = ToolMode(FUNCTIONS, "required")
    assert [c["function"]["name"] for c in required.calls('[{"name": "g", "parameters": {}}]')[1]] == ["g"]
    assert required.calls("[]") is None and required.calls("{") is None
    named = ToolMode(FUNCTIONS, "named", named="g")
    assert named.calls('{"x": 1}')[1][0]["function"] == {"name": "g", "arguments": '{"x": 1}'}


def test_streamed_text_waits_only_where_a_call_may_begin():
    hermes, llama = ToolMode(FUNCTIONS, "auto", format="hermes"), ToolMode(FUNCTIONS, "auto", format="llama3_json")
    assert not hermes.may_start("Hello there") and hermes.may_start("Hello <tool") and hermes.may_start("<tool_call>{")
    assert llama.may_start("") and llama.may_start('  {"na') and llama.may_start("<|python") \
        and not llama.may_start("Hello")


def test_the_format_is_read_from_the_template():
    trl = pytest.importorskip("trl")
    templates = Path(trl.__file__).parent / "chat_templates"
    assert tool_format((templates / "qwen2_5.jinja").read_text()) == "hermes"
    assert tool_format((templates / "llama3_2.jinja").read_text()) == "llama3_json"
    assert tool_format("{{ '[TOOL_CALLS]' }}") == "mistral"
