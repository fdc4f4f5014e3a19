"""BERTScore equals the bert-score package's precision, recall and F1 with the same encoder (all-MiniLM-L6-v2,
shipped in a package), idf off and on, several layers, multiple references and baseline rescaling."""
import pytest
import torch

from lmkit.errors import MetricError
from lmkit.evaluate.bertscore import bert_score

bert_score_pkg = pytest.importorskip("bert_score")

CANDS = ["The cat sat on the mat.", "hello there", "A quick brown fox jumps over the lazy dog",
         "naïve café — déjà vu", "the the the the", "Python lists are mutable; tuples are not.",
         "x" * 3 + " " + "completely unrelated words about astronomy and stars"]
REFS = ["A cat was sitting on the mat", "hi", "the fast brown fox leapt over a lazy dog", "naive cafe, deja vu",
        "the", "Tuples are immutable, unlike lists in Python.", "a sentence"]


def _theirs(folder, cands, refs, **kw):
    p, r, f = bert_score_pkg.score(cands, refs, model_type=str(folder), device="cpu", **kw)
    return torch.stack([p, r, f], dim=-1)


def _ours(folder, cands, refs, **kw):
    out = bert_score(cands, refs, folder, **kw)
    return torch.stack([out["precision"], out["recall"], out["f1"]], dim=-1)


@pytest.mark.parametrize("num_layers,idf", [(6, False), (3, True), (1, False)])
def test_bertscore_equals_the_bert_score_package(minilm_path, num_layers, idf):
    ours = _ours(minilm_path, CANDS, REFS, num_layers=num_layers, idf=idf)
    theirs = _theirs(minilm_path, CANDS, REFS, num_layers=num_layers, idf=idf, nthreads=0)
    assert torch.allclose(ours, theirs, atol=2e-5), (ours - theirs).abs().max()
    assert ours[0, 2] > ours[6, 2]  # a paraphrase beats an unrelated sentence


def test_bertscore_multiple_references_and_small_batches(minilm_path):
    refs = [[r, "an extra reference"] for r in REFS]
    ours = _ours(minilm_path, CANDS, refs, num_layers=4, batch_size=3)
    theirs = _theirs(minilm_path, CANDS, refs, num_layers=4, batch_size=3)
    assert torch.allclose(ours, theirs, atol=2e-5)


def test_bertscore_baseline_rescaling(minilm_path, tmp_path):
    path = tmp_path / "baseline.tsv"
    path.write_text("LAYER,P,R,F\n" + "".join(f"{i},0.{30 + i},0.{31 + i},0.{29 + i}\n" for i in range(7)))
    ours = _ours(minilm_path, CANDS, REFS, num_layers=5, baseline_path=path)
    theirs = _theirs(minilm_path, CANDS, REFS, num_layers=5, rescale_with_baseline=True, baseline_path=str(path),
                     lang="en")
    assert torch.allclose(ours, theirs, atol=3e-5)
    raw = _ours(minilm_path, CANDS, REFS, num_layers=5)
    assert torch.allclose(ours[:, 0], (raw[:, 0] - 0.35) / 0.65, atol=1e-6)


def test_an_empty_sentence_scores_zero(minilm_path):
    """bert-score sets the scores of an empty candidate or reference to 0 (its own call of it fails under
    transformers 5, so this is checked against the rule)."""
    out = bert_score(["", "a cat"], ["a cat", ""], minilm_path)
    assert out["f1"].tolist() == [0.0, 0.0] and out["precision"].tolist() == [0.0, 0.0]


def test_bertscore_bad_input(minilm_path):
    with pytest.raises(MetricError, match="one reference"):
        bert_score(["a", "b"], ["a"], minilm_path)
    with pytest.raises(MetricError, match="num_layers"):
        bert_score(["a"], ["a"], minilm_path, num_layers=9)
