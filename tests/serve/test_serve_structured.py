"""Structured outputs through the openai SDK on a random model: every json_schema / json_object completion parses
and validates (jsonschema), a choice request returns exactly one of the choices, a regex request matches, an EBNF
grammar holds, in batches where constrained and free requests decode together (the free ones still equal
model.generate); a grammar that does not compile, or two constraints at once, is a 400 naming the problem."""
import json
import re
import threading

import pytest
import torch

openai = pytest.importorskip("openai")
jsonschema = pytest.importorskip("jsonschema")
pytest.importorskip("xgrammar")
pytest.importorskip("fastapi")
pytest.importorskip("transformers")
from serving_folders import RunningServer, make_folder  # noqa: E402

SCHEMA = {"type": "object", "properties": {
    "name": {"type": "string", "maxLength": 6}, "age": {"type": "integer", "minimum": 0, "maximum": 99},
    "tags": {"type": "array", "items": {"enum": ["a", "b", "naïve"]}, "maxItems": 2}, "ok": {"type": "boolean"}},
    "required": ["name", "age", "ok"], "additionalProperties": False}
FLAT = {"type": "object", "properties": {"n": {"type": "integer", "minimum": 0, "maximum": 9},
                                         "kind": {"enum": ["x", "y"]}}, "required": ["n", "kind"]}


@pytest.fixture(scope="module")
def served(tmp_path_factory):
    folder = make_folder(tmp_path_factory.mktemp("structured"), "llama", n_positions=256)
    with RunningServer(folder, max_concurrency=8) as server:
        yield server


@pytest.fixture(scope="module")
def client(served):
    return openai.OpenAI(base_url=served.url + "/v1", api_key="unused", max_retries=0, timeout=120)


def _schema_format(schema):
    return {"type": "json_schema", "json_schema": {"name": "answer", "schema": schema, "strict": True}}


def test_every_schema_completion_parses_and_validates(client):
    answer = client.chat.completions.create(model="m", messages=[{"role": "user", "content": "who?"}], n=4, seed=1,
                                            max_tokens=150, temperature=1.0, response_format=_schema_format(SCHEMA))
    for choice in answer.choices:
        assert choice.finish_reason == "stop", choice.message.content
        jsonschema.validate(json.loads(choice.message.content), SCHEMA)
    stream = client.completions.create(model="m", prompt="data:", max_tokens=150, temperature=0, stream=True,
                                       extra_body={"guided_json": SCHEMA})
    text = "".join(c.choices[0].text for c in stream if c.choices)
    jsonschema.validate(json.loads(text), SCHEMA)
    anything = client.chat.completions.create(model="m", messages=[{"role": "user", "content": "hi"}], max_tokens=120,
                                              temperature=0.7, seed=4, response_format={"type": "json_object"},
                                              extra_body={"top_k": 3})
    if anything.choices[0].finish_reason == "stop":  # a free object may outgrow max_tokens; a finished one parses
        assert isinstance(json.loads(anything.choices[0].message.content), dict)
    else:
        assert anything.choices[0].message.content.startswith("{")


def test_choice_regex_grammar_and_whitespace(client):
    choices = ["yes", "no", "naïve café"]
    for seed in range(3):
        text = client.completions.create(model="m", prompt="pick:", max_tokens=20, temperature=1.0, seed=seed,
                                         extra_body={"guided_choice": choices}).choices[0].text
        assert text in choices
    pattern = r"[a-z]{2,5}-[0-9]{1,3}"
    out = client.completions.create(model="m", prompt="id:", max_tokens=30, temperature=1.0, seed=2, n=3,
                                    extra_body={"structured_outputs": {"regex": pattern}})
    assert all(re.fullmatch(pattern, c.text) and c.finish_reason == "stop" for c in out.choices)
    ebnf = 'root ::= "(" num ("," num)? ")"\nnum ::= [1-9] [0-9]?'
    text = client.completions.create(model="m", prompt="pair:", max_tokens=30, temperature=0,
                                     extra_body={"guided_grammar": ebnf}).choices[0].text
    assert re.fullmatch(r"\([1-9][0-9]?(,[1-9][0-9]?)?\)", text)
    tight = client.completions.create(model="m", prompt="x", max_tokens=60, temperature=1.0, seed=0, extra_body={
        "structured_outputs": {"json": FLAT, "disable_any_whitespace": True}}).choices[0].text
    assert tight == json.dumps(json.loads(tight))  # no whitespace beyond the one of ", " and ": "


def test_constrained_and_free_requests_share_a_batch(served, client):
    model, tok = served.state.model, served.state.tokenizer
    results, errors = {}, []

    def run(key, **kwargs):
        try:
            results[key] = client.completions.create(model="m", temperature=0, **kwargs).choices[0]
        except Exception as exc:  # noqa: BLE001 - reported below
            errors.append(exc)

    jobs = [("free0", {"prompt": "hello world", "max_tokens": 24}),
            ("json", {"prompt": "data:", "max_tokens": 150, "extra_body": {"guided_json": SCHEMA}}),
            ("free1", {"prompt": "def f(x):", "max_tokens": 24}),
            ("choice", {"prompt": "pick:", "max_tokens": 10, "extra_body": {"guided_choice": ["up", "down"]}}),
            ("regex", {"prompt": "n:", "max_tokens": 10, "extra_body": {"guided_regex": "[0-9]{4}"}})]
    threads = [threading.Thread(target=run, args=(k,), kwargs=kw) for k, kw in jobs]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    assert not errors, errors
    jsonschema.validate(json.loads(results["json"].text), SCHEMA)
    assert results["choice"].text in ("up", "down") and re.fullmatch("[0-9]{4}", results["regex"].text)
    for key, prompt in (("free0", "hello world"), ("free1", "def f(x):")):
        ids = tok.encode(prompt)
        expected = model.generate(torch.tensor([ids]), max_new_tokens=24)[0, len(ids):].tolist()
        assert results[key].text == tok.decode(expected, skip_special_tokens=True)


def test_openai_sdk_parse_with_a_pydantic_model(client):
    pydantic = pytest.importorskip("pydantic")

    class Point(pydantic.BaseModel):
        x: int
        y: int
        label: str = pydantic.Field(max_length=4)

    parsed = client.chat.completions.parse(model="m", messages=[{"role": "user", "content": "a point"}],
                                           max_tokens=150, temperature=0.5, seed=3, response_format=Point)
    assert isinstance(parsed.choices[0].message.parsed, Point)


@pytest.mark.parametrize("extra, param, needle", [
    ({"response_format": _schema_format({"type": "objectx"})}, "response_format", "Unsupported type"),
    ({"guided_regex": "[a-"}, "guided_regex", "Unclosed"),
    ({"guided_grammar": "root ::= foo"}, "guided_grammar", "foo"),
    ({"guided_choice": []}, "guided_choice", "non-empty"),
    ({"guided_json": {"type": "object"}, "guided_regex": "a"}, "guided_regex", "only one"),
    ({"response_format": {"type": "xml"}}, "response_format", "json_schema"),
    ({"guided_json": {"type": "object"}, "ignore_eos": True}, "ignore_eos", "end token"),
])
def test_bad_constraints_are_a_400_naming_the_problem(client, extra, param, needle):
    with pytest.raises(openai.BadRequestError) as info:
        client.completions.create(model="m", prompt="x", max_tokens=5, extra_body=extra)
    assert info.value.body["param"] == param and needle in info.value.body["message"]
