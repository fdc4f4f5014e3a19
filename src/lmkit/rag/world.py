"""A seeded synthetic world for knowledge-without-retraining experiments.

Entities have invented two-word names (syllables drawn by a seeded generator, so no pretrained model
knows them) and one value per attribute, drawn uniformly from that attribute's invented values: a
closed-book guess is right with probability 1 / len(values). Each fact is one document, id "NAME/ATTRIBUTE".
"""
from __future__ import annotations

import random
from dataclasses import dataclass

from lmkit.data.corpus import Document

SYLLABLES = ("ka", "lo", "mir", "tes", "van", "dor", "qui", "zel", "ra", "bex", "fu", "nim", "so", "gal", "trek",
             "ul", "pra", "yon", "hes", "wic")
ATTRIBUTES = {
    "city": ("Omber", "Tarsk", "Velun", "Quessa", "Drom", "Ilvar", "Pesk", "Marnow", "Zuth", "Coravel"),
    "colour": ("ochre", "teal", "umber", "mauve", "saffron", "cobalt", "sepia", "jade", "vermilion", "slate"),
    "pet": ("ferret", "heron", "gecko", "lynx", "otter", "raven", "tortoise", "marten", "ibis", "newt"),
}
FACT = {"city": "{name} lives in {value}.", "colour": "The favourite colour of {name} is {value}.",
        "pet": "{name} keeps a {value} as a pet."}
QUESTION = {"city": "Where does {name} live?", "colour": "What is the favourite colour of {name}?",
            "pet": "What animal does {name} keep as a pet?"}


@dataclass(frozen=True)
class Fact:
    name: str
    attribute: str
    value: str

    @property
    def id(self) -> str:
        return f"{self.name}/{self.attribute}"

    def document(self) -> Document:
        return Document(self.id, FACT[self.attribute].format(name=self.name, value=self.value))

    def question(self) -> str:
        return QUESTION[self.attribute].format(name=self.name)


def names(n: int, seed: int = 0) -> list[str]:
    """n distinct invented names "Xxxx Yyyy" (two or three syllables per word)."""
    rng, out, seen = random.Random(seed), [], set()
    while len(out) < n:
        name = " ".join("".join(rng.choice(SYLLABLES) for _ in range(rng.choice((2, 3)))).capitalize()
                        for _ in range(2))
        if name not in seen:
            seen.add(name)
            out.append(name)
    return out


def world(n_entities: int, seed: int = 0) -> list[Fact]:
    """Every attribute of n_entities entities, values drawn uniformly by the seeded generator."""
    rng = random.Random(seed + 1)
    return [Fact(name, attr, rng.choice(values)) for name in names(n_entities, seed)
            for attr, values in ATTRIBUTES.items()]


def changed(fact: Fact, seed: int = 0) -> Fact:
    """The same entity and attribute with another value."""
    rng = random.Random(f"{seed}:{fact.id}")
    return Fact(fact.name, fact.attribute, rng.choice([v for v in ATTRIBUTES[fact.attribute] if v != fact.value]))
