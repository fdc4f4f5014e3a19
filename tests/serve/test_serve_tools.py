"""Tool calls through the openai SDK, for each format a chat template asks for (Hermes/Qwen `<tool_call>` with TRL's
qwen2_5 template, Llama 3 JSON with TRL's llama3_2 template, Mistral `[TOOL_CALLS]`): a reply in the format (forced
by a grammar on a random model) comes back as `tool_calls` with finish_reason "tool_calls", streamed and not (the
SDK's own stream accumulator reads the deltas); tool_choice "required" and a named function are decoded under the
grammar and their arguments validate; a call that does not parse is content with finish_reason "stop"; role "tool"
messages and assistant tool calls go back through the template."""
import json
from pathlib import Path

import pytest

openai = pytest.importorskip("openai")
jsonschema = pytest.importorskip("jsonschema")
pytest.importorskip("xgrammar")
pytest.importorskip("fastapi")
trl = pytest.importorskip("trl")
from serving_folders import RunningServer, make_folder  # noqa: E402

TEMPLATES = Path(trl.__file__).parent / "chat_templates"
MISTRAL = ("{% for m in messages %}{% if m.role == 'user' %}[INST] {{ m.content }} [/INST]{% elif m.role == 'tool' %}"
           "[TOOL_RESULTS]{{ m.content }}[/TOOL_RESULTS]{% elif m.tool_calls %}[TOOL_CALLS]{{ m.tool_calls | "
           "map(attribute='function') | list | tojson }}</s>{% else %}{{ m.content }}</s>{% endif %}{% endfor %}"
           "{% if tools %}[AVAILABLE_TOOLS]{{ tools | tojson }}[/AVAILABLE_TOOLS]{% endif %}")
WEATHER = {"type": "function", "function": {"name": "get_weather", "description": "Weather in a city", "parameters": {
    "type": "object", "properties": {"city": {"type": "string", "maxLength": 5}}, "required": ["city"]}}}
TIME = {"type": "function", "function": {"name": "get_time", "description": "Time in a zone", "parameters": {
    "type": "object", "properties": {"zone": {"enum": ["utc", "cet"]}, "hours": {"type": "integer", "minimum": 0,
                                                                                  "maximum": 23}},
    "required": ["zone", "hours"]}}}
CITY = '"{\\"city\\": \\"" [a-z] [a-z]? [a-z]? "\\"}"'
FORCED = {  # the format's call text, with the arguments {"city": 1-3 letters}
    "hermes": f'root ::= "<tool_call>\\n{{\\"name\\": \\"get_weather\\", \\"arguments\\": " args "}}\\n</tool_call>"\n'
              f'args ::= {CITY}',
    "llama3_json": f'root ::= "{{\\"name\\": \\"get_weather\\", \\"parameters\\": " args "}}"\nargs ::= {CITY}',
    "mistral": f'root ::= "[TOOL_CALLS][{{\\"name\\": \\"get_weather\\", \\"arguments\\": " args "}}]"\n'
               f'args ::= {CITY}'}
MESSAGES = [{"role": "user", "content": "weather in paris?"}]


@pytest.fixture(scope="module", params=["hermes", "llama3_json", "mistral", "hermes-process"])
def served(request, tmp_path_factory):  # hermes-process: the engine in a child process (`lmkit serve`'s default)
    form = request.param.removesuffix("-process")
    folder = make_folder(tmp_path_factory.mktemp(form), "llama", n_positions=2048)
    template = {"hermes": (TEMPLATES / "qwen2_5.jinja").read_text(), "mistral": MISTRAL,
                "llama3_json": (TEMPLATES / "llama3_2.jinja").read_text()}[form]
    config = json.loads((folder / "tokenizer_config.json").read_text())
    (folder / "tokenizer_config.json").write_text(json.dumps({**config, "chat_template": template}))
    with RunningServer(folder, max_concurrency=4, engine_process=request.param.endswith("-process")) as server:
        server.format = form
        yield server


@pytest.fixture(scope="module")
def client(served):
    return openai.OpenAI(base_url=served.url + "/v1", api_key="unused", max_retries=0, timeout=120)


def _check_weather(message):
    (call,) = message.tool_calls
    assert call.type == "function" and call.function.name == "get_weather" and call.id
    jsonschema.validate(json.loads(call.function.arguments), WEATHER["function"]["parameters"])


def test_a_call_in_the_templates_format_becomes_tool_calls(served, client):
    extra = {"guided_grammar": FORCED[served.format]}
    answer = client.chat.completions.create(model="m", messages=MESSAGES, tools=[WEATHER, TIME], max_tokens=200,
                                            temperature=0.8, seed=1, extra_body=extra)
    assert answer.choices[0].finish_reason == "tool_calls" and not answer.choices[0].message.content
    _check_weather(answer.choices[0].message)
    with client.chat.completions.stream(model="m", messages=MESSAGES, tools=[WEATHER, TIME], max_tokens=200,
                                        temperature=0.8, seed=1, extra_body=extra) as stream:
        final = stream.get_final_completion()
    assert final.choices[0].finish_reason == "tool_calls"
    _check_weather(final.choices[0].message)
    assert final.choices[0].message.tool_calls[0].function.arguments == \
        answer.choices[0].message.tool_calls[0].function.arguments  # the same seed: the same call


def test_required_and_named_tool_choice_are_decoded_under_the_grammar(client):
    for stream in (False, True):
        kwargs = dict(model="m", messages=MESSAGES, tools=[WEATHER, TIME], max_tokens=250, temperature=1.0, seed=2)
        if stream:
            with client.chat.completions.stream(tool_choice="required", **kwargs) as s:
                required = s.get_final_completion()
        else:
            required = client.chat.completions.create(tool_choice="required", **kwargs)
        calls = required.choices[0].message.tool_calls
        assert required.choices[0].finish_reason == "tool_calls" and calls
        schemas = {t["function"]["name"]: t["function"]["parameters"] for t in (WEATHER, TIME)}
        for call in calls:
            jsonschema.validate(json.loads(call.function.arguments), schemas[call.function.name])
    single = client.chat.completions.create(tool_choice="required", parallel_tool_calls=False, **kwargs)
    assert len(single.choices[0].message.tool_calls) == 1
    named = client.chat.completions.create(model="m", messages=MESSAGES, tools=[WEATHER, TIME], max_tokens=200,
                                           tool_choice={"type": "function", "function": {"name": "get_time"}})
    (call,) = named.choices[0].message.tool_calls
    assert call.function.name == "get_time"
    jsonschema.validate(json.loads(call.function.arguments), TIME["function"]["parameters"])


def test_an_unparsable_call_is_content_and_tool_messages_go_back(served, client):
    broken = 'root ::= "<tool_call>\\n{\\"name\\": \\"nope\\"\\n</tool_call>"' if served.format == "hermes" \
        else 'root ::= "[TOOL_CALLS][{\\"name\\": 1}]"' if served.format == "mistral" else 'root ::= "{\\"name\\": 1"'
    answer = client.chat.completions.create(model="m", messages=MESSAGES, tools=[WEATHER], max_tokens=100,
                                            temperature=0, extra_body={"guided_grammar": broken})
    choice = answer.choices[0]
    assert choice.finish_reason == "stop" and not choice.message.tool_calls and choice.message.content
    none = client.chat.completions.create(model="m", messages=MESSAGES, tools=[WEATHER], tool_choice="none",
                                          max_tokens=5, temperature=0)
    assert not none.choices[0].message.tool_calls
    history = MESSAGES + [
        {"role": "assistant", "content": None, "tool_calls": [{"id": "call_1", "type": "function", "function": {
            "name": "get_weather", "arguments": json.dumps({"city": "paris"})}}]},
        {"role": "tool", "tool_call_id": "call_1", "content": "sunny, 21 C"}]
    back = client.chat.completions.create(model="m", messages=history, tools=[WEATHER], max_tokens=5, temperature=0)
    assert back.choices[0].finish_reason in ("stop", "length", "tool_calls")
    rendered = served.state.tokenizer.decode(client.post("/../tokenize", cast_to=object, body={"messages": history})
                                             ["tokens"])
    assert "sunny, 21 C" in rendered and '{"city": "paris"}' in rendered  # the arguments as an object, not text


@pytest.mark.parametrize("extra, param", [({"tool_choice": "required"}, "tool_choice"),
                                          ({"tools": [{"type": "function"}]}, "tools"),
                                          ({"tools": [WEATHER], "tool_choice": {"type": "function", "function": {
                                              "name": "other"}}}, "tool_choice"),
                                          ({"tools": [WEATHER], "tool_choice": "required",
                                            "response_format": {"type": "json_object"}}, "tool_choice")])
def test_bad_tools_are_a_400(client, extra, param):
    with pytest.raises(openai.BadRequestError) as info:
        client.chat.completions.create(model="m", messages=MESSAGES, max_tokens=5, extra_body=extra)
    assert info.value.body["param"] == param


def test_plain_text_still_streams_beside_tools(client):
    text = "hi <b> there, all of you"
    chunks = list(client.chat.completions.create(model="m", messages=MESSAGES, tools=[WEATHER], max_tokens=100,
                                                 temperature=0, stream=True,
                                                 extra_body={"guided_grammar": f'root ::= "{text}"'}))
    pieces = [c.choices[0].delta.content for c in chunks if c.choices and c.choices[0].delta.content]
    assert "".join(pieces) == text and len(pieces) > 2  # sent as it came, not held to the end
    assert [c.choices[0].finish_reason for c in chunks if c.choices and c.choices[0].finish_reason] == ["stop"]
