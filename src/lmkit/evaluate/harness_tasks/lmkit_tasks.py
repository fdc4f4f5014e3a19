"""Datasets of lmkit's offline lm-eval tasks, generated in process from seeded code and the running interpreter's
documentation: nothing is downloaded. Each function is a task's `custom_dataset` and returns a DatasetDict; the
YAML beside it passes its `dataset_kwargs` as keyword arguments (and lm-eval adds the task's metadata)."""
from __future__ import annotations

import random
import re

from lmkit.data import load_corpus
from lmkit.data.translation import PREFIX, make_pairs

ADDITION_TEST = 200  # problems per number of digits
ADDITION_TRAIN = 50  # few-shot exemplars per number of digits
MC_TEST = 300
MC_CHOICES = 4
MC_PROMPT_CHARS = 300


def _dataset(splits: dict[str, list[dict]]):
    import datasets

    return datasets.DatasetDict({name: datasets.Dataset.from_list(rows) for name, rows in splits.items()})


# --- multiple choice: which module does this docstring come from? ---------------------------------------
def module_docstrings() -> list[tuple[str, str]]:
    """(module, its module docstring's first paragraph with the module's own name masked) from pydocs."""

    out = []
    for doc in load_corpus("pydocs"):
        if not doc.id.startswith("doc:"):
            continue
        module = doc.id[len("doc:"):]
        first, _, rest = doc.text.partition("\n")
        if first != module:  # the module itself has no docstring: the text opens with a function's
            continue
        paragraph = rest.strip().split("\n\n")[0].strip()
        for name in sorted({module, module.rsplit(".", 1)[-1]}, key=len, reverse=True):
            paragraph = re.sub(rf"\b{re.escape(name)}\b", "___", paragraph)
        paragraph = " ".join(paragraph.split())[:MC_PROMPT_CHARS]
        if len(paragraph) >= 20:
            out.append((module, paragraph))
    return out


def pydoc_mc(seed: int = 0, **_) -> object:
    """Four-choice questions: a module docstring and four module names, one of them right."""
    entries = module_docstrings()
    rng = random.Random(seed)
    names = [m for m, _ in entries]
    rows = []
    for module, paragraph in entries:
        others = rng.sample([n for n in names if n != module], MC_CHOICES - 1)
        gold = rng.randrange(MC_CHOICES)
        choices = others[:gold] + [module] + others[gold:]
        rows.append({"docstring": paragraph, "choices": choices, "gold": gold, "module": module})
    rng.shuffle(rows)
    return _dataset({"test": rows[:MC_TEST], "train": rows[MC_TEST:]})


# --- numbers -> English words ------------------------------------------------------------------------------
def numbers(n_train: int = 200, **_) -> object:
    """lmkit's translation task as few-shot generation: the held-out numbers (3 to 6 digits) to test,
    training numbers as exemplars."""

    train, test = make_pairs(n_train=n_train)

    def row(pair):
        return {"number": pair[0][len(PREFIX):], "words": pair[1]}
    return _dataset({"test": [row(p) for p in test], "train": [row(p) for p in train]})


# --- addition, with and without worked steps -----------------------------------------------------------------
def place_parts(n: int) -> list[int]:
    """n by place value, zero places left out: 153 -> [100, 50, 3]."""
    digits = str(n)
    parts = [int(d) * 10 ** (len(digits) - 1 - i) for i, d in enumerate(digits)]
    return [p for p in parts if p] or [0]


def addition_trace(a: int, b: int) -> str:
    """The worked sum place by place: 15+27 = (10+5)+(20+7) = 30+12 = 42. The answer is 42."""
    def group(n: int) -> str:
        parts = place_parts(n)
        return f"({'+'.join(map(str, parts))})" if len(parts) > 1 else str(parts[0])

    width = max(len(str(a)), len(str(b)))
    place_sums = []
    for place in reversed(range(width)):
        s = (a // 10 ** place % 10 + b // 10 ** place % 10) * 10 ** place
        if s:
            place_sums.append(s)
    steps = [f"{a}+{b}", f"{group(a)}+{group(b)}"]
    if len(place_sums) > 1:
        steps.append("+".join(map(str, place_sums)))
    steps.append(str(a + b))
    return " = ".join(dict.fromkeys(steps)) + f". The answer is {a + b}."


def addition_problems(digits: int, count: int, rng: random.Random, avoid: set = frozenset()) -> list[tuple[int, int]]:
    low, high = (1 if digits == 1 else 10 ** (digits - 1)), 10 ** digits - 1
    space = (high - low + 1) ** 2 - len(avoid)
    count = min(count, space)
    seen: set[tuple[int, int]] = set()
    out = []
    while len(out) < count:
        pair = (rng.randint(low, high), rng.randint(low, high))
        if pair not in seen and pair not in avoid:
            seen.add(pair)
            out.append(pair)
    return out


def addition_rows(pairs, digits: int) -> list[dict]:
    return [{"question": f"{a}+{b}", "trace": addition_trace(a, b), "direct": f"The answer is {a + b}.",
             "answer": str(a + b), "digits": digits} for a, b in pairs]


def addition_splits(digits: int = 2, seed: int = 0) -> tuple[list[tuple[int, int]], list[tuple[int, int]]]:
    """(test, exemplar) problems of addition_*_d{digits}: exemplars never repeat a test problem."""
    rng = random.Random(f"addition-{digits}-{seed}")
    low = 1 if digits == 1 else 10 ** (digits - 1)
    space = (10 ** digits - low) ** 2  # one digit has 81 problems: some are kept back as exemplars
    test = addition_problems(digits, min(ADDITION_TEST, space - ADDITION_TRAIN), rng)
    return test, addition_problems(digits, ADDITION_TRAIN, rng, avoid=set(test))


def addition(digits: int = 2, seed: int = 0, **_) -> object:
    """`digits`-digit + `digits`-digit problems; exemplars never repeat a test problem."""
    test, train = addition_splits(digits, seed)
    return _dataset({"test": addition_rows(test, digits), "train": addition_rows(train, digits)})


# --- rolling perplexity over pydocs' validation split ----------------------------------------------------
def pydocs_validation(**_) -> object:
    """The documents `lmkit eval --corpus pydocs` scores: pydocs' held-out split, in its order."""

    _, validation = load_corpus("pydocs").split()
    return _dataset({"test": [{"id": d.id, "text": d.text} for d in validation]})


# --- text to train a small model on --------------------------------------------------------------------------
def exemplar_texts(n_numbers: int = 200) -> list[str]:
    """The exemplars of addition_cot_d2 and numbers as their few-shot prompts lay them out (question, answer,
    and the blank line between shots): a small model trained on these answers those tasks in their format."""
    texts = [f"Question: {r['question']}\nAnswer: {r['trace']}\n\n" for r in addition(digits=2)["train"]]
    return texts + [f"Number: {r['number']}\nIn words: {r['words']}\n\n" for r in numbers(n_train=n_numbers)["train"]]
