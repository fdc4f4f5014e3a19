"""Prompt-lookup speculation (generation/prompt_lookup.py) and the harness's greedy decoding built on it: drafts
are what followed the latest earlier occurrence of the longest suffix, and decoding with drafts checked (holes in
the cache where they fail) chooses exactly the tokens of plain greedy decoding."""
import random
from types import SimpleNamespace

import pytest
import torch

from lmkit import CausalLM, get_preset
from lmkit.evaluate import harness_generate
from lmkit.generation import prompt_lookup
from lmkit.generation.prompt_lookup import MAX_DRAFT, NgramIndex, accepted, next_budget


def reference_draft(seq: list[int], k: int, max_n: int = 3) -> list[int]:
    """The definition, by brute force: longest suffix (n <= max_n) seen ending earlier, its latest end, and the k
    tokens after it in seq followed by the draft itself."""
    for n in range(min(max_n, len(seq)), 0, -1):
        ends = [e for e in range(n - 1, len(seq) - 1) if seq[e - n + 1:e + 1] == seq[-n:]]
        if ends:
            virtual = list(seq)
            for j in range(k):
                virtual.append(virtual[ends[-1] + 1 + j])
            return virtual[len(seq):]
    return []


def test_drafts_equal_the_definition_on_random_sequences():
    rng = random.Random(0)
    for _ in range(300):
        seq = [rng.randrange(rng.choice([2, 3, 6, 40])) for _ in range(rng.randrange(0, 30))]
        index = NgramIndex(seq[:len(seq) // 2])
        for t in seq[len(seq) // 2:]:  # built by appending, as decoding builds it
            index.append(t)
        for k in (0, 1, 4, MAX_DRAFT):
            assert index.draft(k) == (reference_draft(seq, k) if k else []), (seq, k)


def test_a_repeating_tail_is_drafted_as_its_repetition():
    index = NgramIndex([5, 1, 2, 3, 1, 2, 3])
    assert index.draft(7) == [1, 2, 3, 1, 2, 3, 1]  # the source runs into the draft, as LZ77 copies
    assert NgramIndex([4, 4]).draft(3) == [4, 4, 4]
    assert NgramIndex([1, 2, 3]).draft(3) == []  # 3 never occurred before the end


def test_acceptance_and_budget():
    assert accepted([4, 5, 6], [4, 5, 9, 1]) == 3  # two draft tokens kept, then the model's own choice
    assert accepted([4, 5], [7, 5, 6]) == 1
    assert accepted([], [7]) == 1
    assert next_budget(2, 2, 2) == 4 and next_budget(MAX_DRAFT, MAX_DRAFT, MAX_DRAFT) == MAX_DRAFT
    assert next_budget(6, 6, 2) == 3
    budget, drafted = next_budget(4, 4, 0), 0  # a failed draft: no drafts for a while, then a probe of one
    for _ in range(20):
        if budget >= 1:
            break
        budget, drafted = next_budget(budget, 0, None), drafted + 1
    assert budget == 1 and drafted == 8


def _lm(model, eos: int | None):
    tok = SimpleNamespace(encode=lambda s, add_special_tokens=False: [ord(c) % 50 for c in s],
                          decode=lambda ids: "".join(chr(65 + i % 26) for i in ids))
    model.generation_defaults = {"eos_token_id": eos}
    return SimpleNamespace(model=model, tokenizer=tok, backend="causal")


@pytest.mark.parametrize("family", ["llama", "gpt2"])
@pytest.mark.parametrize("eos", [None, 7])
@torch.inference_mode()
def test_speculative_greedy_decoding_chooses_plain_greedy_tokens(family, eos, monkeypatch):
    """Left-padded rows of different lengths whose prompts repeat (so drafts are found, some kept, some
    rejected), with and without an EOS that finishes rows early: the same tokens as `generate`'s greedy loop,
    and most tokens came from checked drafts."""
    torch.manual_seed(0)
    config = get_preset(family, d_model=32, n_layers=2, n_heads=4, vocab_size=50, max_seq_len=96,
                        **({"n_kv_heads": 2} if family == "llama" else {}))
    model = CausalLM(config).eval()
    gen = torch.Generator().manual_seed(1)
    rows = []
    for r in range(4):
        motif = torch.randint(8, 50, (3 + r,), generator=gen).tolist()
        rows.append((motif * 6)[:10 + 3 * r])
    width = max(map(len, rows))
    ids = torch.zeros(len(rows), width, dtype=torch.long)
    mask = torch.zeros_like(ids)
    for i, r in enumerate(rows):
        ids[i, width - len(r):], mask[i, width - len(r):] = torch.tensor(r), 1
    kept = []
    verify = prompt_lookup.verify_drafts
    monkeypatch.setattr(harness_generate, "verify_drafts", lambda *a: kept.append(a[2].shape[1]) or verify(*a))
    got = harness_generate.greedy_until(_lm(model, eos), ids, mask, 40, [], pad=0)
    want = model.generate(ids, attention_mask=mask, max_new_tokens=40, do_sample=False, pad_token_id=0,
                          eos_token_id=eos)
    if eos is None:
        assert torch.equal(got, want)
    else:  # generate stops once every row has finished; the harness's rule stops there too
        assert torch.equal(got[:, :want.shape[1]], want) and bool((got[:, want.shape[1]:] == 0).all())
    assert kept and sum(kept) > 2 * len(kept)  # drafts of more than one token were checked
