"""The numbers-to-words translation task: the data, its tokenizer, and a short training run end to end."""
from __future__ import annotations

import json
import random

import pytest
import torch

import lmkit
from lmkit.data.translation import PREFIX, make_pairs, number_to_words, task_tokenizer, vocabulary

_VALUES = {w: i for i, w in enumerate("zero one two three four five six seven eight nine ten eleven twelve thirteen "
                                      "fourteen fifteen sixteen seventeen eighteen nineteen".split())}
_VALUES.update({w: 10 * i for i, w in enumerate("_ _ twenty thirty forty fifty sixty seventy eighty ninety".split())
                if i >= 2})


def _parse(words: str) -> int:
    """The inverse of number_to_words, written independently."""
    total, group = 0, 0
    for w in words.split():
        if w == "hundred":
            group *= 100
        elif w == "thousand":
            total, group = (total + group) * 1000, 0
        else:
            group += _VALUES[w]
    return total + group


def test_number_to_words():
    assert number_to_words(0) == "zero"
    assert number_to_words(40517) == "forty thousand five hundred seventeen"
    assert number_to_words(100100) == "one hundred thousand one hundred"
    assert number_to_words(999999) == "nine hundred ninety nine thousand nine hundred ninety nine"
    rng = random.Random(0)
    vocab = set(vocabulary())
    for n in list(range(0, 1200)) + [rng.randint(0, 999_999) for _ in range(2000)]:
        words = number_to_words(n)
        assert _parse(words) == n and set(words.split()) <= vocab
    with pytest.raises(ValueError):
        number_to_words(1_000_000)


def test_pairs_are_disjoint_and_the_tokenizer_round_trips(tmp_path):
    train, test = make_pairs(3000, 200, seed=1)
    assert len(test) == 200 and not {s for s, _ in train} & {s for s, _ in test}
    assert all(s.startswith(PREFIX) for s, _ in train + test)
    assert {int(s[len(PREFIX):]) for s, _ in train} >= set(range(10))  # single digits are learnt, not held out
    tok = task_tokenizer()
    tokenizers = pytest.importorskip("tokenizers")
    tok.save(tmp_path / "tokenizer.json")
    ref = tokenizers.Tokenizer.from_file(str(tmp_path / "tokenizer.json"))
    for s, t in test[:50]:
        ids = tok.encode(s)
        assert ids == ref.encode(s).ids and tok.decode(ids, skip_special_tokens=True) == ref.decode(ids)  # tokenizers skips them by default
        assert tok.token_to_id("<unk>") not in ids
        assert ids[-1] == tok.token_to_id("</s>")  # sources end with EOS, as T5's tokenizer ends them
        assert tok.decode(tok.encode(t, add_special_tokens=False)) == t


def test_short_training_run_writes_a_t5_folder(tmp_path):
    """A few steps: the loss falls, metrics and curves are written, transformers loads the model and
    generates what lmkit generates."""
    from lmkit.train.translation import fit_pairs

    train, test = make_pairs(2000, 40, seed=2)
    result = fit_pairs(train, test, task_tokenizer(), tmp_path, steps=40, batch_size=32, eval_every=40, lr=2e-3,
                       warmup_steps=5, log_every=10, task="numbers", d_model=64, n_layers=1, n_decoder_layers=1,
                       n_heads=2, head_dim=32, d_ff=128, output_scale=64 ** -0.5)
    rows = [json.loads(line) for line in (tmp_path / "metrics.jsonl").read_text().splitlines()]
    assert rows[-1]["loss"] < rows[0]["loss"] and "bleu" in rows[-1] and 0 <= result["bleu"] <= 100
    assert (tmp_path / "loss_curve.png").is_file() and json.loads((tmp_path / "task.json").read_text()) == {"task": "numbers"}
    transformers = pytest.importorskip("transformers")
    ours = lmkit.load_model(tmp_path)
    theirs = transformers.T5ForConditionalGeneration.from_pretrained(tmp_path).eval()
    tok = lmkit.load_tokenizer(tmp_path)
    ids = torch.tensor([tok.encode(test[0][0])])  # the source as training fed it: ids + EOS
    expected = theirs.generate(ids, max_new_tokens=12, do_sample=False, num_beams=1)
    assert ours.generate(ids, max_new_tokens=12).tolist() == expected.tolist()


def test_pair_training_adds_the_experts_load_balancing_loss(tmp_path):
    """A T5 with experts: each step adds router_aux_loss_coef * aux_loss (it was left out, so the coefficient
    changed nothing), as lmkit train, fine-tuning and distillation do."""
    from lmkit.train.translation import fit_pairs

    train, test = make_pairs(200, 4, seed=3)
    routers = {}
    for coef in (0.0, 10.0):
        fit_pairs(train, test, task_tokenizer(), tmp_path / f"run{coef}", steps=3, batch_size=8, eval_every=100,
                  warmup_steps=1, log_every=1, d_model=32, n_layers=1, n_decoder_layers=1, n_heads=2, d_ff=48,
                  n_experts=4, family=None, router_aux_loss_coef=coef, dropout=0.0)
        state = lmkit.load_model(tmp_path / f"run{coef}").state_dict()
        routers[coef] = {n: p for n, p in state.items() if ".sublayer.gate." in n}  # the routers
    assert routers[0.0] and routers[0.0].keys() == routers[10.0].keys()
    assert any(not torch.equal(routers[0.0][n], routers[10.0][n]) for n in routers[0.0])
