"""Infilling: `/v1/completions` with `suffix` (OpenAI's insert mode, through the openai SDK) and `lmkit generate
--prefix/--suffix` give the middle that generate writes after the FIM prompt; a model without sentinels is refused."""
import pytest
import torch

import lmkit
from lmkit.cli import main
from lmkit.data.fim import infill_prompt

openai = pytest.importorskip("openai")
pytest.importorskip("fastapi")
pytest.importorskip("uvicorn")
pytest.importorskip("transformers")
from serving_folders import RunningServer, make_folder  # noqa: E402

PREFIX, SUFFIX = "def add(a, b):\n    ", "\n    return c\n"


@pytest.fixture(scope="module")
def fim_folder(tmp_path_factory):
    return make_folder(tmp_path_factory.mktemp("fim"), "llama", fim=True, chat=False, n_positions=128)


@pytest.fixture(scope="module")
def plain_folder(tmp_path_factory):
    return make_folder(tmp_path_factory.mktemp("plain"), "gpt2", chat=False, n_positions=128)


def _middle(folder, prefix, suffix, max_new_tokens, **settings):
    model, tok = lmkit.load_model(folder), lmkit.load_tokenizer(folder)
    ids = infill_prompt(tok, prefix, suffix)  # a pretrained-style folder (no <|pad|>): no BOS before <fim_prefix>
    assert ids[0] == tok.token_to_id("<fim_prefix>") and ids[-1] == tok.token_to_id("<fim_middle>")
    out = model.generate(torch.tensor([ids]), max_new_tokens=max_new_tokens, **settings)[0, len(ids):].tolist()
    return tok.decode(out, skip_special_tokens=True), len(ids)


def test_insert_mode_and_generate_prefix_suffix_give_the_same_middle(fim_folder, capsys):
    want, prompt_len = _middle(fim_folder, PREFIX, SUFFIX, 10)
    with RunningServer(fim_folder, max_concurrency=2, max_queue=4) as server:
        client = openai.OpenAI(base_url=server.url + "/v1", api_key="unused", max_retries=0, timeout=60)
        got = client.completions.create(model="m", prompt=PREFIX, suffix=SUFFIX, max_tokens=10, temperature=0)
        assert got.choices[0].text == want
        assert got.usage.prompt_tokens == prompt_len
        two = client.completions.create(model="m", prompt=[PREFIX, "x = "], suffix=SUFFIX, max_tokens=6, temperature=0)
        assert [c.text for c in sorted(two.choices, key=lambda c: c.index)] == [
            _middle(fim_folder, p, SUFFIX, 6)[0] for p in (PREFIX, "x = ")]
        with pytest.raises(openai.BadRequestError, match="echo"):
            client.completions.create(model="m", prompt=PREFIX, suffix=SUFFIX, echo=True, max_tokens=2)
        with pytest.raises(openai.BadRequestError, match="list of strings"):
            client.completions.create(model="m", prompt=[1, 2], suffix=SUFFIX, max_tokens=2)
    assert main(["generate", "--model", str(fim_folder), "--prefix", PREFIX, "--suffix", SUFFIX,
                 "--max-new-tokens", "10"]) == 0
    assert capsys.readouterr().out == want + "\n"


def test_a_model_without_sentinels_is_refused_clearly(plain_folder, capsys):
    with RunningServer(plain_folder, max_concurrency=2, max_queue=4) as server:
        client = openai.OpenAI(base_url=server.url + "/v1", api_key="unused", max_retries=0, timeout=60)
        with pytest.raises(openai.BadRequestError, match="no fill-in-the-middle tokens") as caught:
            client.completions.create(model="m", prompt=PREFIX, suffix=SUFFIX, max_tokens=4)
        assert caught.value.body["param"] == "suffix"
    assert main(["generate", "--model", str(plain_folder), "--prefix", PREFIX, "--suffix", SUFFIX]) == 2
    err = capsys.readouterr().err
    assert "no fill-in-the-middle tokens" in err and "--objective fim" in err
    assert main(["generate", "--model", str(plain_folder), "--prompt", "a", "--suffix", "b"]) == 2
    assert "not both" in capsys.readouterr().err
