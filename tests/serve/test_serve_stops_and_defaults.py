"""`lmkit serve` stops a reply at every end token the folder declares (the chat template's end-of-turn included, as
vLLM and transformers do), takes unset sampling fields from generation_config.json, and refuses what OpenAI's API
refuses (another model's name, an unknown role, a GET on a POST route) in OpenAI's error shape."""
import json

import pytest
import torch

import lmkit

openai = pytest.importorskip("openai")
httpx = pytest.importorskip("httpx")
pytest.importorskip("fastapi")
pytest.importorskip("transformers")
from serving_folders import RunningServer, make_folder, make_scripted_folder  # noqa: E402

from lmkit.chat_session import CHAT_SAMPLING, end_ids  # noqa: E402

MESSAGES = [{"role": "user", "content": "how do I save json?"}]
REPLY = "Use json.dumps(x)."
AFTER = " then json.dump(f"  # what the model says past its end of turn: never shown


def _client(server):
    return openai.OpenAI(base_url=server.url + "/v1", api_key="unused", max_retries=0, timeout=60)


@pytest.fixture(scope="module", params=["template", "generation_config"])
def tuned(request, tmp_path_factory):
    """A folder that says REPLY, <|im_end|>, then AFTER: its end of turn known from the chat template alone, or also
    from the generation_config.json `finetune --task sft` writes."""
    folder = make_scripted_folder(tmp_path_factory.mktemp(request.param), MESSAGES, REPLY, end="<|im_end|>",
                                  after=AFTER)
    if request.param == "generation_config":
        model, tok = lmkit.load_model(folder), lmkit.load_tokenizer(folder)
        (folder / "generation_config.json").write_text(json.dumps({**CHAT_SAMPLING,
                                                                   "eos_token_id": end_ids(model, tok)}))
    with RunningServer(folder) as server:
        yield server


def test_chat_reply_stops_at_the_end_of_turn(tuned):
    client = _client(tuned)
    tok = tuned.state.tokenizer
    answer = client.chat.completions.create(model="m", messages=MESSAGES, max_tokens=40, temperature=0,
                                            logprobs=True)
    choice = answer.choices[0]
    assert choice.message.content == REPLY and choice.finish_reason == "stop"
    tokens = [t.token for t in choice.logprobs.content]
    assert tokens[-1] == "<|im_end|>" and "".join(tokens[:-1]) == REPLY  # nothing decoded past the end of turn
    assert answer.usage.completion_tokens == len(tok.encode(REPLY, add_special_tokens=False)) + 1
    shown, finish = "", None
    for chunk in client.chat.completions.create(model="m", messages=MESSAGES, max_tokens=40, temperature=0,
                                                stream=True):
        for c in chunk.choices:
            shown += c.delta.content or ""
            finish = c.finish_reason or finish
    assert shown == REPLY and finish == "stop"
    prompt = tok.apply_chat_template(MESSAGES, add_generation_prompt=True, tokenize=False)
    completion = client.completions.create(model="m", prompt=prompt, max_tokens=40, temperature=0).choices[0]
    assert completion.text == REPLY and completion.finish_reason == "stop"


@pytest.fixture(scope="module")
def sampled(tmp_path_factory):
    folder = make_folder(tmp_path_factory.mktemp("sampled"), "llama", n_positions=128)
    defaults = json.loads((folder / "generation_config.json").read_text())
    (folder / "generation_config.json").write_text(json.dumps({**defaults, **CHAT_SAMPLING}))
    with RunningServer(folder) as server:
        yield server, folder


def test_unset_sampling_fields_take_the_folders_generation_config(sampled):
    server, folder = sampled
    client = _client(server)
    card = client.models.list().data[0]
    assert card.sampling_defaults == {"temperature": 0.7, "top_p": 0.9}
    model, tok = lmkit.load_model(folder), lmkit.load_tokenizer(folder)
    ids = tok.encode("The quick")
    answer = client.completions.create(model="m", prompt="The quick", max_tokens=12, seed=7).choices[0]
    torch.manual_seed(7)
    expected = model.generate(torch.tensor([ids]), max_new_tokens=12, do_sample=True, temperature=0.7, top_p=0.9,
                              top_k=0)[0, len(ids):].tolist()
    assert answer.text == tok.decode([i for i in expected if i != model.config.eos_token_id])
    greedy = client.completions.create(model="m", prompt="The quick", max_tokens=12, temperature=0).choices[0]
    expected = model.generate(torch.tensor([ids]), max_new_tokens=12, do_sample=False)[0, len(ids):].tolist()
    assert greedy.text == tok.decode([i for i in expected if i != model.config.eos_token_id])


def test_requests_openai_refuses_are_refused_in_its_shape(sampled):
    server, _ = sampled
    client = _client(server)
    with pytest.raises(openai.NotFoundError) as caught:
        client.chat.completions.create(model="gpt-4", messages=MESSAGES, max_tokens=4)
    assert caught.value.code == "model_not_found" and "gpt-4" in caught.value.message
    with pytest.raises(openai.NotFoundError):
        client.completions.create(model="gpt-4", prompt="hi", max_tokens=4)
    with pytest.raises(openai.BadRequestError, match="wizard"):
        client.chat.completions.create(model="m", messages=[{"role": "wizard", "content": "hi"}], max_tokens=4)
    for path in ("/v1/chat/completions", "/v1/completions", "/v1/embeddings", "/tokenize"):
        answer = httpx.get(server.url + path)
        assert answer.status_code == 405 and answer.headers["allow"] == "POST", path
        assert answer.json()["error"]["code"] == "method_not_allowed"
    messages = []
    for value in (-1, 0):
        with pytest.raises(openai.BadRequestError) as caught:
            client.chat.completions.create(model="m", messages=MESSAGES, max_tokens=value)
        messages.append(caught.value.body["message"])
    assert messages == ["max_tokens: must be at least 1, got -1", "max_tokens: must be at least 1, got 0"]
    with pytest.raises(openai.BadRequestError, match="must be at least 0, got -1"):
        client.completions.create(model="m", prompt="hi", max_tokens=-1)
    ok = client.chat.completions.create(model="m", messages=[{"role": "developer", "content": "be brief"}, *MESSAGES],
                                        max_tokens=2, temperature=0)
    assert ok.choices[0].finish_reason in ("stop", "length")
