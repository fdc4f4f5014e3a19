"""BLEU equals the score sacrebleu's command prints; ROUGE equals Google's rouge-score."""
from __future__ import annotations

import random
import subprocess
import sys
from pathlib import Path

import pytest

from lmkit.errors import LmkitError, MetricError
from lmkit.evaluate.bleu import corpus_bleu
from lmkit.evaluate.rouge import corpus_rouge, lcs_length, rouge_detail, rouge_scores

HYPS = ["The cat sat on the mat.", "Ein Hund läuft über die Straße — schnell!", "", "a b c d e f g",
        "naïve café costs 3,50 €", "identical line here", "short"]
REFS = ["The cat is sitting on the mat.", "Ein Hund rennt über die Straße, schnell!", "something", "a b c d e f g h",
        "the naïve café costs 3.50 €", "identical line here", "a much longer reference than the hypothesis"]
REFS2 = ["A cat sat on a mat.", "Der Hund läuft schnell über die Straße!", "nothing", "a b c d e f g",
         "café costs 3,50 €", "identical line", "short too"]


def _cli(tmp_path: Path, hyps, *refs, extra=()) -> float:
    (tmp_path / "hyp.txt").write_text("\n".join(hyps) + "\n", encoding="utf-8")
    names = []
    for i, r in enumerate(refs):
        (tmp_path / f"ref{i}.txt").write_text("\n".join(r) + "\n", encoding="utf-8")
        names.append(str(tmp_path / f"ref{i}.txt"))
    cmd = [sys.executable, "-m", "sacrebleu", *names, "-i", str(tmp_path / "hyp.txt"), "-b", "-w", "6", *extra]
    return float(subprocess.run(cmd, capture_output=True, text=True, check=True).stdout.strip())


def test_bleu_equals_sacrebleu_command(tmp_path):
    assert corpus_bleu(HYPS, REFS).score == pytest.approx(_cli(tmp_path, HYPS, REFS), abs=1e-6)
    two = corpus_bleu(HYPS, [REFS, REFS2]).score
    assert two == pytest.approx(_cli(tmp_path, HYPS, REFS, REFS2), abs=1e-6)
    assert two > corpus_bleu(HYPS, REFS).score  # a second reference can only add matches here
    low = corpus_bleu(HYPS, REFS, lowercase=True).score
    assert low == pytest.approx(_cli(tmp_path, HYPS, REFS, extra=("-lc",)), abs=1e-6)


def test_bleu_properties():
    lines = ["one two three four five", "six seven eight nine ten eleven"]
    assert corpus_bleu(lines, lines).score == pytest.approx(100.0)
    assert corpus_bleu(["x y z w"] * 2, lines).score == pytest.approx(0.0)
    # brevity penalty: a correct but short hypothesis scores exp(1 - r / c) of the full precision
    short = corpus_bleu(["one two three four"], ["one two three four five"])
    assert short.precisions == pytest.approx([100.0] * 4)
    assert short.bp == pytest.approx(2.718281828 ** (1 - 5 / 4))
    with pytest.raises(LmkitError, match="reference"):
        corpus_bleu(["a", "b"], ["a"])


def test_bleu_api_parity_and_clear_errors():
    """Inputs sacrebleu's API scores (None for a missing reference, several tokenizers, any sequence type)
    give its numbers; inputs it crashes on (KeyError, IndexError, TypeError) give a MetricError."""
    from sacrebleu.metrics import BLEU

    hyps, refs = ["今天 天气 很好 3,50 €!", "naïve café, e.g. 1.000"], ["今天天气很好 3.50 €!", "the naïve café 1.000"]
    second = [None, "naive café , e.g. 1,000"]  # the first segment has one reference, the second two
    for tok in ("13a", "intl", "char", "none", "zh"):
        ours, theirs = corpus_bleu(hyps, [refs, second], tokenize=tok), BLEU(tokenize=tok).corpus_score(hyps, [refs, second])
        assert (ours.score, ours.counts, ours.totals, ours.sys_len, ours.ref_len) == \
               (theirs.score, theirs.counts, theirs.totals, theirs.sys_len, theirs.ref_len), tok
    assert corpus_bleu(iter(hyps), tuple(refs)).score == BLEU().corpus_score(hyps, [refs]).score
    with pytest.raises(LmkitError, match="at least one hypothesis"):
        corpus_bleu([], [])  # sacrebleu: IndexError
    with pytest.raises(LmkitError, match="unknown BLEU tokenizer 'foo'.*13a"):
        corpus_bleu(hyps, refs, tokenize="foo")  # sacrebleu: KeyError
    with pytest.raises(LmkitError, match="hypothesis 0 has no reference"):
        corpus_bleu(hyps, [[None, "x"], [None, "y"]])  # sacrebleu: TypeError
    with pytest.raises(LmkitError, match="hypotheses must be strings"):
        corpus_bleu(["a", None], ["a", "b"])
    try:
        BLEU(tokenize="ko-mecab")
    except (ImportError, RuntimeError):
        with pytest.raises(LmkitError, match="'ko-mecab' is not available.*pip install"):
            corpus_bleu(hyps, refs, tokenize="ko-mecab")


def test_bleu_smoothing_and_orders_equal_sacrebleu():
    from sacrebleu.metrics import BLEU

    hyps, refs = ["the cat sat", "a dog", ""], ["the cat sat down", "the dog", "nothing here"]
    for kw in [dict(smooth_method="exp"), dict(smooth_method="floor", smooth_value=0.1), dict(smooth_method="add-k"),
               dict(smooth_method="add-k", smooth_value=2), dict(smooth_method="none"), dict(effective_order=True),
               dict(max_ngram_order=2), dict(max_ngram_order=6, smooth_method="floor", effective_order=True)]:
        ours, theirs = corpus_bleu(hyps, refs, **kw), BLEU(**kw).corpus_score(hyps, [refs])
        assert (ours.score, ours.counts, ours.totals, ours.bp) == (theirs.score, theirs.counts, theirs.totals, theirs.bp)
        one = BLEU(**kw).sentence_score(hyps[0], [refs[0]])  # sentence BLEU is the corpus BLEU of one line
        assert corpus_bleu(hyps[:1], refs[:1], **kw).score == one.score, kw
    with pytest.raises(LmkitError, match="unknown smooth_method 'add-one'"):
        corpus_bleu(hyps, refs, smooth_method="add-one")  # sacrebleu: AssertionError
    with pytest.raises(LmkitError, match="max_ngram_order"):
        corpus_bleu(hyps, refs, max_ngram_order=0)  # sacrebleu: a score of 0 with no precisions


def test_rouge_equals_rouge_score():
    rouge_scorer = pytest.importorskip("rouge_score.rouge_scorer")
    scorer = rouge_scorer.RougeScorer(["rouge1", "rouge2", "rougeL"], use_stemmer=False)
    rng = random.Random(0)
    words = "the a cat dog sat ran on under mat rug quickly".split()
    pairs = list(zip(HYPS, REFS)) + [(" ".join(rng.choices(words, k=rng.randint(0, 12))),
                                      " ".join(rng.choices(words, k=rng.randint(1, 12)))) for _ in range(40)]
    for hyp, ref in pairs:
        ours = rouge_detail(hyp, ref)
        theirs = scorer.score(ref, hyp)  # rouge-score takes (target, prediction)
        for key in ours:
            for part in ("precision", "recall", "fmeasure"):
                assert getattr(ours[key], part) == pytest.approx(getattr(theirs[key], part), abs=1e-12), \
                    (hyp, ref, key, part)
            assert rouge_scores(hyp, ref)[key] == ours[key].fmeasure
    corpus = corpus_rouge([h for h, _ in pairs], [r for _, r in pairs])
    for key in ("rouge1", "rouge2", "rougeL"):
        for name, part in ((key, "fmeasure"), (f"{key}_precision", "precision"), (f"{key}_recall", "recall")):
            mean = sum(getattr(scorer.score(r, h)[key], part) for h, r in pairs) / len(pairs)
            assert corpus[name] == pytest.approx(mean, abs=1e-12), name


def test_rouge_hand_computed():
    # hyp "the cat sat", ref "the cat was sitting": unigrams 2/3, 2/4 -> F1 = 4/7; bigrams 1/2, 1/3 -> 2/5
    s = rouge_scores("The cat sat.", "the cat was sitting")
    assert s["rouge1"] == pytest.approx(4 / 7) and s["rouge2"] == pytest.approx(2 / 5)
    one = rouge_detail("The cat sat.", "the cat was sitting")["rouge1"]
    assert (one.precision, one.recall) == pytest.approx((2 / 3, 2 / 4))  # recall: over the reference's unigrams
    assert lcs_length(list("ABCBDAB"), list("BDCABA")) == 4  # the textbook LCS example
    assert rouge_scores("", "anything") == {"rouge1": 0.0, "rouge2": 0.0, "rougeL": 0.0}
    assert rouge_scores("same words", "Same, words!")["rougeL"] == 1.0


@pytest.mark.parametrize("hyps, refs", [(["a"], [None]), ([3], ["a"]), (["a", b"b"], ["a", "b"])])
def test_rouge_refuses_non_strings(hyps, refs):
    with pytest.raises(MetricError, match="must be strings"):
        corpus_rouge(hyps, refs)


def _formula_bleu(hyps: list[str], refs: list[list[str]], max_n: int = 4) -> float:
    """The texts' BLEU, written out: BP * exp(sum_n 1/N log p_n), p_n the clipped n-gram precision pooled over the
    corpus (each n-gram counted at most as often as in the reference that holds it most), BP = min(1, exp(1 - r/c))
    with r the sum of the reference lengths closest to each hypothesis's (the shorter on a tie)."""
    import math
    from collections import Counter
    matched, total, c, r = [0] * max_n, [0] * max_n, 0, 0
    for hyp, ref_set in zip(hyps, refs):
        h, rs = hyp.split(), [x.split() for x in ref_set]
        c += len(h)
        r += min((abs(len(x) - len(h)), len(x)) for x in rs)[1]
        for n in range(1, max_n + 1):
            grams = Counter(tuple(h[i:i + n]) for i in range(len(h) - n + 1))
            most = Counter()
            for x in rs:
                most |= Counter(tuple(x[i:i + n]) for i in range(len(x) - n + 1))
            matched[n - 1] += sum((grams & most).values())
            total[n - 1] += sum(grams.values())
    if min(matched) == 0:
        return 0.0
    bp = 1.0 if c > r else math.exp(1 - r / c)
    return 100 * bp * math.exp(sum(math.log(m / t) for m, t in zip(matched, total)) / max_n)


def test_bleu_equals_the_formula_on_hand_built_cases():
    """lmkit's BLEU against the formula itself (not sacrebleu against itself), so the test can fail."""
    # one pair worked by hand: hyp 6 words, ref 7; p = 5/6, 3/5, 1/4, 0/3 -> 0 without smoothing
    assert corpus_bleu(["the cat sat on the mat"], ["the cat is on the mat today"],
                       smooth_method="none").score == 0.0
    # p1 = 6/7, p2 = 4/6, p3 = 2/5, p4 = 1/4; c = 7 < r = 8 -> BP = exp(1 - 8/7)
    hyp, ref = "the cat sat on the red mat", "the cat sat on a red mat today"
    import math
    want = 100 * math.exp(1 - 8 / 7) * (6 / 7 * 4 / 6 * 2 / 5 * 1 / 4) ** 0.25
    assert corpus_bleu([hyp], [ref], smooth_method="none").score == pytest.approx(want, rel=1e-12)
    assert _formula_bleu([hyp], [[ref]]) == pytest.approx(want, rel=1e-12)
    # random corpora over a small vocabulary, one and two references, no punctuation (13a leaves words alone)
    rng = random.Random(3)
    words = "a b c d e f the cat".split()
    for _ in range(30):
        n = rng.randint(1, 6)
        hyps = [" ".join(rng.choices(words, k=rng.randint(4, 14))) for _ in range(n)]
        refs = [[" ".join(rng.choices(words, k=rng.randint(4, 14))) for _ in range(n)] for _ in range(rng.randint(1, 2))]
        ours = corpus_bleu(hyps, refs, smooth_method="none").score
        assert ours == pytest.approx(_formula_bleu(hyps, [list(x) for x in zip(*refs)]), rel=1e-9, abs=1e-9)
    # clipping: "the the the the" against "the cat" has p1 = 1/4, not 4/4
    assert corpus_bleu(["the the the the"], ["the cat"], smooth_method="none", max_ngram_order=1).score == \
        pytest.approx(25.0)
