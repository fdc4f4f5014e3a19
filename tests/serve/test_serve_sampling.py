"""vLLM's sampling extensions on both endpoints through the openai SDK's extra_body: ignore_eos, min_tokens, top_k,
min_p, repetition_penalty decode what model.generate decodes with the same settings (min_tokens is generate's
min_new_tokens over every end id); bad values are a 400."""
import pytest
import torch

import lmkit

openai = pytest.importorskip("openai")
pytest.importorskip("fastapi")
pytest.importorskip("transformers")
from serving_folders import RunningServer, make_folder, make_scripted_folder  # noqa: E402

from lmkit.chat_session import end_ids  # noqa: E402

MESSAGES = [{"role": "user", "content": "say hi"}]
REPLY = "hello world"


def _client(server):
    return openai.OpenAI(base_url=server.url + "/v1", api_key="unused", max_retries=0, timeout=60)


@pytest.fixture(scope="module")
def scripted(tmp_path_factory):
    folder = make_scripted_folder(tmp_path_factory.mktemp("scripted"), MESSAGES, REPLY)
    with RunningServer(folder) as server:
        yield server


@pytest.fixture(scope="module")
def random_llama(tmp_path_factory):
    folder = make_folder(tmp_path_factory.mktemp("llama"), "llama", n_positions=128)
    with RunningServer(folder, max_concurrency=4) as server:
        yield server


def test_ignore_eos_and_min_tokens_fix_the_length(scripted):
    client, state = _client(scripted), scripted.state
    plain = client.chat.completions.create(model="m", messages=MESSAGES, max_tokens=20, temperature=0)
    assert plain.choices[0].message.content == REPLY and plain.choices[0].finish_reason == "stop"
    assert plain.usage.completion_tokens < 20
    fixed = client.chat.completions.create(model="m", messages=MESSAGES, max_tokens=20, temperature=0,
                                           extra_body={"ignore_eos": True})
    assert fixed.usage.completion_tokens == 20 and fixed.choices[0].finish_reason == "length"
    assert fixed.choices[0].message.content.startswith(REPLY)
    model, tok = state.model, state.tokenizer
    prompt = tok.encode(tok.apply_chat_template(MESSAGES, add_generation_prompt=True, tokenize=False),
                        add_special_tokens=False)
    expected = model.generate(torch.tensor([prompt]), max_new_tokens=20, min_new_tokens=15,
                              eos_token_id=end_ids(model, tok))[0, len(prompt):].tolist()
    least = client.chat.completions.create(model="m", messages=MESSAGES, max_tokens=20, temperature=0,
                                           logprobs=True, extra_body={"min_tokens": 15})
    assert least.usage.completion_tokens == len(expected) >= 15
    assert [t.token for t in least.choices[0].logprobs.content] == [tok.decode([i]) for i in expected]
    for stream in (False, True):  # the completions endpoint takes them too
        text = tok.decode(prompt)
        out = client.completions.create(model="m", prompt=text, max_tokens=9, temperature=0, stream=stream,
                                        extra_body={"ignore_eos": True, "min_tokens": 9})
        if stream:
            chunks = list(out)
            finish = [c.choices[0].finish_reason for c in chunks if c.choices and c.choices[0].finish_reason]
            assert finish == ["length"]
        else:
            assert out.usage.completion_tokens == 9 and out.choices[0].finish_reason == "length"


def test_top_k_min_p_and_repetition_penalty_equal_generate(random_llama):
    client, state = _client(random_llama), random_llama.state
    model, tok = state.model, state.tokenizer
    ids = tok.encode("The quick brown")
    settings = {"top_k": 7, "min_p": 0.05, "repetition_penalty": 1.4}
    for endpoint in ("completions", "chat"):
        if endpoint == "chat":
            messages = [{"role": "user", "content": "naïve café"}]
            ids = tok.encode(tok.apply_chat_template(messages, add_generation_prompt=True, tokenize=False),
                             add_special_tokens=False)
            answer = client.chat.completions.create(model="m", messages=messages, max_tokens=14, temperature=0.8,
                                                    seed=3, logprobs=True, extra_body=settings)
            got = [t.token for t in answer.choices[0].logprobs.content]
        else:
            answer = client.completions.create(model="m", prompt="The quick brown", max_tokens=14, temperature=0.8,
                                               seed=3, logprobs=0, extra_body=settings)
            got = answer.choices[0].logprobs.tokens
        torch.manual_seed(3)
        expected = model.generate(torch.tensor([ids]), max_new_tokens=14, do_sample=True, temperature=0.8,
                                  eos_token_id=end_ids(model, tok), **settings)[0, len(ids):].tolist()
        assert got == [tok.decode([i]) for i in expected]
    greedy = client.completions.create(model="m", prompt="hello world", max_tokens=12, temperature=0,
                                       extra_body={"repetition_penalty": 2.0}).choices[0].text
    ids = tok.encode("hello world")
    expected = model.generate(torch.tensor([ids]), max_new_tokens=12, repetition_penalty=2.0)[0, len(ids):].tolist()
    assert greedy == tok.decode(expected, skip_special_tokens=True)


@pytest.mark.parametrize("extra", [{"min_tokens": 30}, {"min_tokens": -1}, {"ignore_eos": "yes"}, {"top_k": -2},
                                   {"min_p": 1.5}, {"repetition_penalty": 0}])
def test_bad_sampling_extensions_are_400(random_llama, extra):
    with pytest.raises(openai.BadRequestError) as info:
        _client(random_llama).completions.create(model="m", prompt="hi", max_tokens=10, extra_body=extra)
    assert info.value.body["param"] == next(iter(extra))


def test_min_tokens_holds_back_stop_strings_too(scripted):
    client = _client(scripted)
    first = len(scripted.state.tokenizer.encode("hello", add_special_tokens=False))
    cut = client.chat.completions.create(model="m", messages=MESSAGES, max_tokens=20, temperature=0, stop=["hello"])
    assert cut.choices[0].message.content == "" and cut.choices[0].finish_reason == "stop"
    for stream in (False, True):
        kept = client.chat.completions.create(model="m", messages=MESSAGES, max_tokens=20, temperature=0,
                                              stop=["hello"], stream=stream, extra_body={"min_tokens": first + 1})
        text = "".join(c.choices[0].delta.content or "" for c in kept if c.choices) if stream \
            else kept.choices[0].message.content
        assert text.startswith(REPLY)  # "hello" ended within the first min_tokens tokens: no stop
