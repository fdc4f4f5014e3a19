"""pydocs-instruct: pairs split by pydocs' own documents, answers as the docstrings give them, deterministic."""
import pytest

from lmkit.data import load_corpus
from lmkit.data.instruct import build_pydocs_instruct, first_paragraph, pydocs_instruct


def test_split_follows_pydocs_documents_and_answers_come_from_the_docstrings():
    train, val = pydocs_instruct("train"), pydocs_instruct("validation")
    tr_docs, va_docs = load_corpus("pydocs").split()
    assert {r["doc"] for r in val} <= {d.id for d in va_docs}
    assert {r["doc"] for r in train} <= {d.id for d in tr_docs}
    assert not {r["doc"] for r in train} & {r["doc"] for r in val}
    assert len(val) > 100 and len(train) > 20 * len(val) / 2
    by_q = {r["messages"][0]["content"]: r["messages"][1]["content"] for r in train + val}
    import json
    assert by_q["What does `json.dumps` do?"] == first_paragraph(json.dumps.__doc__)
    assert by_q["Show the signature of `json.dumps`."].startswith("json.dumps(obj, *, skipkeys=False")
    assert all(0 < len(r["messages"][1]["content"]) <= 304 for r in train + val)
    assert len({r["id"] for r in train + val}) == len(train) + len(val)


def test_first_paragraph_cuts_at_a_sentence_end():
    text = "One two. " * 50 + "\n\nSecond paragraph."
    cut = first_paragraph(text, 40)
    assert cut == "One two. One two. One two. One two. One two." [:cut.__len__()] and cut.endswith(".")
    assert len(cut) <= 40 and "Second" not in first_paragraph(text)
    assert first_paragraph("Spans\nlines here.\n\nNot this.") == "Spans lines here."


@pytest.mark.slow
def test_building_twice_gives_the_same_pairs():
    assert build_pydocs_instruct(use_cache=False) == build_pydocs_instruct(use_cache=False)
