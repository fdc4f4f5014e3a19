"""StopText: over any stream of byte-level tokens (characters split across tokens included), the pieces it lets
out join to the final text, every piece shown is a prefix of that text, no stop string is ever shown, and the
final text ends right before the first stop."""
import random

import lmkit
from lmkit.serve.text import StopText
from serving_folders import TEXTS


def test_held_back_text_never_leaks_and_joins_to_the_final_text():
    tok = lmkit.train_tokenizer(TEXTS, kind="bpe", vocab_size=300, special_tokens=["<|endoftext|>"])
    rng = random.Random(0)
    source = "naïve café — 東京 🙂 stop here STOP there, the quick brown fox"
    checked = 0
    for trial in range(200):
        ids = [rng.randrange(tok.vocab_size) for _ in range(rng.randrange(1, 30))] if trial % 2 else \
            tok.encode(source[rng.randrange(10):])
        text = tok.decode(ids)
        start = rng.randrange(max(len(text) - 2, 1))
        stops = [text[start:start + rng.randrange(1, 4)], "zzz"] if trial % 3 else ["東京", "fox"]
        stream = StopText(tok, stops, set())
        shown = ""
        for k in range(1, len(ids) + 1):
            shown += stream.push(ids[:k], final=k == len(ids))
            assert not any(s in shown for s in stops if s)
            if stream.stopped:
                break
        cuts = [text.find(s) for s in stops if s and s in text]
        expected = text[:min(cuts)] if cuts else text
        assert shown == stream.text == expected, (ids, stops)
        checked += bool(cuts)
    assert checked > 50  # most trials really hit a stop
