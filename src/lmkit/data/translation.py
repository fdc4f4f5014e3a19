"""A translation task made by code: numbers written in digits -> the same numbers in English words.

"translate numbers to words: 40517" -> "forty thousand five hundred seventeen". Numbers go up to
999,999, drawn with a uniform number of digits (1 to 6) so short and long ones are equally common;
the held-out numbers (3 to 6 digits) never occur in the training set. The task carries its own word-level
tokenizer (digits split one per token), saved as a tokenizer.json that `tokenizers` reads.
"""
from __future__ import annotations

import random

from lmkit.tokenizers.added_tokens import AddedToken
from lmkit.tokenizers.models.wordpiece import WordLevel
from lmkit.tokenizers.pre_tokenizers import Sequence, Split, WhitespaceSplit
from lmkit.tokenizers.processors import TemplateProcessing
from lmkit.tokenizers.tokenizer import Tokenizer

PREFIX = "translate numbers to words: "
MAX_NUMBER = 999_999
SPECIALS = ("<pad>", "</s>", "<unk>")  # ids 0, 1, 2: pad (= decoder start, as in T5), eos, unk

_ONES = ("zero one two three four five six seven eight nine ten eleven twelve thirteen fourteen fifteen sixteen "
         "seventeen eighteen nineteen").split()
_TENS = "_ _ twenty thirty forty fifty sixty seventy eighty ninety".split()


def _below_thousand(n: int) -> list[str]:
    words = []
    if n >= 100:
        words += [_ONES[n // 100], "hundred"]
        n %= 100
    if n >= 20:
        words.append(_TENS[n // 10])
        n %= 10
        if n:
            words.append(_ONES[n])
    elif n or not words:
        words.append(_ONES[n])
    return words


def number_to_words(n: int) -> str:
    """English words of 0 <= n <= 999,999 (no "and", no hyphens): 40517 -> forty thousand five hundred seventeen."""
    if not 0 <= n <= MAX_NUMBER:
        raise ValueError(f"number_to_words covers 0..{MAX_NUMBER}, got {n}")
    if n < 1000:
        return " ".join(_below_thousand(n))
    words = _below_thousand(n // 1000) + ["thousand"]
    if n % 1000:
        words += _below_thousand(n % 1000)
    return " ".join(words)


def _sample(rng: random.Random, min_digits: int = 1) -> int:
    digits = rng.randint(min_digits, 6)
    low = 0 if digits == 1 else 10 ** (digits - 1)
    return rng.randint(low, 10 ** digits - 1)


def make_pairs(n_train: int = 20000, n_test: int = 500, seed: int = 0) -> tuple[list[tuple[str, str]], list[tuple[str, str]]]:
    """(train, held-out) lists of (source, target); no number is in both."""
    rng = random.Random(seed)
    test: set[int] = set()
    while len(test) < n_test:  # 3 to 6 digits: the numbers below 100 (the words themselves) are all trained on
        test.add(_sample(rng, min_digits=3))
    train = []
    while len(train) < n_train:
        n = _sample(rng)
        if n not in test:
            train.append(n)

    def pair(n: int) -> tuple[str, str]:
        return PREFIX + str(n), number_to_words(n)

    return [pair(n) for n in train], [pair(n) for n in sorted(test, key=lambda _: rng.random())]


def vocabulary() -> list[str]:
    words = set(_ONES) | set(_TENS[2:]) | {"hundred", "thousand"} | set(PREFIX.split()) | set("0123456789")
    return list(SPECIALS) + sorted(words)


def task_tokenizer():
    """Word-level tokenizer of the task: whitespace-split words, one token per digit, <pad> </s> <unk>;
    like T5's, it ends each text with </s> (add_special_tokens=True), as sources are fed in training."""
    vocab = {w: i for i, w in enumerate(vocabulary())}
    added = [AddedToken(s, vocab[s], special=True) for s in SPECIALS]
    pre = Sequence([WhitespaceSplit(), Split({"Regex": "\\d"}, behavior="Isolated")])
    eos = {"</s>": {"id": "</s>", "ids": [vocab["</s>"]], "tokens": ["</s>"]}}
    return Tokenizer(WordLevel(vocab, unk_token="<unk>"), pre_tokenizer=pre, added_tokens=added,
                     post_processor=TemplateProcessing(["$A", "</s>"], ["$A", "</s>", "$B", "</s>"], eos),
                     special_tokens_map={"pad_token": "<pad>", "eos_token": "</s>", "unk_token": "<unk>"})
