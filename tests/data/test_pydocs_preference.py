"""pydocs-preference: deterministic conversational pairs whose rejected answer is another symbol's answer to a
question of the same kind from the same split."""
import re

from lmkit.data.instruct import pydocs_instruct, pydocs_preference
from lmkit.finetune.preference_data import read_preference_rows


def test_pairs_are_deterministic_and_reject_another_answer_of_the_same_kind_and_split():
    for split in ("train", "validation"):
        rows = pydocs_preference(split)
        assert rows == pydocs_preference(split)
        answers = {}
        for r in pydocs_instruct(split):
            kind = re.sub(r"`[^`]*`", "`X`", r["messages"][0]["content"])
            answers.setdefault(kind, set()).add(r["messages"][-1]["content"])
        assert len(rows) > 0.95 * len(pydocs_instruct(split))
        for r in rows:
            chosen, rejected = r["chosen"][0]["content"], r["rejected"][0]["content"]
            assert chosen != rejected
            assert rejected in answers[re.sub(r"`[^`]*`", "`X`", r["prompt"][0]["content"])]
    held = {r["doc"] for r in pydocs_preference("validation")}
    assert not held & {r["doc"] for r in pydocs_preference("train")}
    rows, kind = read_preference_rows("pydocs-preference:validation")
    assert kind == "conversational" and [r for _, r in rows] == pydocs_preference("validation")
