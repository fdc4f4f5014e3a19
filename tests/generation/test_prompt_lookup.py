"""Prompt-lookup speculation (generation/prompt_lookup.py) and the harness's greedy decoding built on it: drafts
are what followed the latest earlier occurrence of the longest suffix, and decoding with drafts checked (holes in
the cache where they fail) chooses exactly the tokens of plain greedy decoding."""
import random
from types import SimpleNamespace

import pytest
import torch

from lmkit import CausalLM, get_preset
from lmkit.errors import GenerationError
from lmkit.evaluate import harness_generate
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
    assert next_budget(6, 6, 2) == 3 and next_budget(4, 4, 0) == -7


def _lm(model, eos: int | None):
    tok = SimpleNamespace(encode=lambda s, add_special_tokens=False: [ord(c) % 50 for c in s],
                          decode=lambda ids: "".join(chr(65 + i % 26) for i in ids))
    model.generation_defaults = {"eos_token_id": eos}
    return SimpleNamespace(model=model, tokenizer=tok, backend="causal")


@pytest.mark.parametrize("family", ["llama", "gpt2"])
@pytest.mark.parametrize("with_eos", [False, True])
@torch.inference_mode()
def test_speculative_greedy_decoding_chooses_plain_greedy_tokens(family, with_eos, monkeypatch):
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
    eos = None
    if with_eos:  # the last row's fifth new token: that row finishes early and pads while others go on
        eos = int(model.generate(ids, attention_mask=mask, max_new_tokens=5, eos_token_id=[])[-1, -1])
    kept = []
    verify = CausalLM.draft_logits
    monkeypatch.setattr(CausalLM, "draft_logits", lambda self, *a: kept.append(a[1].shape[1]) or verify(self, *a))
    got = harness_generate.generate_rows(_lm(model, eos), ids, mask, 40, [], pad=0)
    want = model.generate(ids, attention_mask=mask, max_new_tokens=40, do_sample=False, pad_token_id=0,
                          eos_token_id=eos)
    # generate stops once every row has finished, and pads finished rows; the harness's rule is the same here
    assert torch.equal(got, want)
    if eos is not None:  # the last row met the EOS, so finishing and padding were exercised
        assert bool((want[-1, ids.shape[1]:ids.shape[1] + 5] == eos).any())
    assert kept and sum(kept) > 2 * len(kept)  # drafts of more than one token were checked


def _repeating_batch(rows: int, vocab: int, seed: int) -> tuple[torch.Tensor, torch.Tensor]:
    """Left-padded prompts of different lengths that repeat a short motif, so that drafts are found."""
    gen = torch.Generator().manual_seed(seed)
    prompts = [(torch.randint(3, vocab, (2 + r,), generator=gen).tolist() * 6)[:8 + 3 * r] for r in range(rows)]
    width = max(map(len, prompts))
    ids = torch.zeros(rows, width, dtype=torch.long)
    mask = torch.zeros_like(ids)
    for i, p in enumerate(prompts):
        ids[i, width - len(p):], mask[i, width - len(p):] = torch.tensor(p), 1
    return ids, mask


# "seen": the last row's fifth new token, so that a row does finish early (and pads while others go on)
OPTIONS = [dict(), dict(eos_token_id="seen", pad_token_id=0), dict(repetition_penalty=1.3, no_repeat_ngram_size=4),
           dict(eos_token_id=["seen", 6], min_new_tokens=7, pad_token_id=0), dict(max_matching_ngram_size=3)]


FAMILIES = {"llama": dict(n_kv_heads=2), "gpt2": {},
            # decoded one token at a time (a dynamic RoPE base follows a forward's furthest position)
            "llama-dynamic-rope": dict(n_kv_heads=2, max_seq_len=20, rope_scaling={"type": "dynamic", "factor": 2.0})}


@pytest.mark.parametrize("options", OPTIONS, ids=["plain", "eos", "processors", "min-new", "ngram3"])
@pytest.mark.parametrize("family", list(FAMILIES))
@torch.inference_mode()
def test_generate_with_prompt_lookup_chooses_the_tokens_of_plain_greedy(family, options, monkeypatch):
    """generate(prompt_lookup_num_tokens=k) on left-padded batches: the one-token loop's tokens and padding, with
    logits processors read on each drafted position's own context, and drafts really checked."""
    torch.manual_seed(0)
    config = get_preset(family.split("-")[0], d_model=32, n_layers=2, n_heads=4, vocab_size=40,
                        **{"max_seq_len": 128, **FAMILIES[family]})
    model = CausalLM(config).eval()
    ids, mask = _repeating_batch(3, 40, 4)
    seen = int(model.generate(ids, attention_mask=mask, max_new_tokens=5, eos_token_id=[])[-1, -1])
    if "eos_token_id" in options:
        eos = options["eos_token_id"]
        options = {**options, "eos_token_id": [seen if e == "seen" else e for e in eos] if isinstance(eos, list) else seen}
    checked = []
    verify = CausalLM.draft_logits
    monkeypatch.setattr(CausalLM, "draft_logits", lambda self, *a: checked.append(a[1].shape[1]) or verify(self, *a))
    for k in (1, 3, 10):
        got = model.generate(ids, attention_mask=mask, max_new_tokens=30, prompt_lookup_num_tokens=k, **options)
        want = model.generate(ids, attention_mask=mask, max_new_tokens=30, **options)
        assert torch.equal(got, want), k
        if "eos_token_id" in options and "min_new_tokens" not in options:  # the last row did finish early
            assert want.shape[1] < ids.shape[1] + 30 or bool((want[-1, ids.shape[1] + 5:] == 0).all())
        single = model.generate(ids[2:], max_new_tokens=30, prompt_lookup_num_tokens=k, **options)
        assert torch.equal(single, model.generate(ids[2:], max_new_tokens=30, **options)), k
    assert (not checked) if "dynamic" in family else (checked and max(checked) > 2)


@torch.inference_mode()
def test_prompt_lookup_equals_transformers_prompt_lookup_and_streams(tmp_path):
    """transformers' generate(prompt_lookup_num_tokens=...) (assisted decoding, batch 1) on the same folder gives
    the same ids, and a TextStreamer-style streamer sees every new token once, in order."""
    transformers = pytest.importorskip("transformers")
    from helpers.hub_pairs import randomized, saved_pair

    torch.manual_seed(0)
    hf = randomized(transformers.LlamaForCausalLM(transformers.LlamaConfig(
        vocab_size=101, hidden_size=32, intermediate_size=48, num_hidden_layers=2, num_attention_heads=4,
        num_key_value_heads=2, max_position_embeddings=128, bos_token_id=1, eos_token_id=2)))
    hf, ours, _ = saved_pair(hf, "llama", SimpleNamespace(mktemp=lambda name: tmp_path / name))
    ids, _ = _repeating_batch(3, 101, 7)
    prompt = ids[2:, (ids[2] == 0).sum():]  # the longest row has no padding
    for k in (2, 10):
        want = hf.generate(prompt, max_new_tokens=40, do_sample=False, prompt_lookup_num_tokens=k,
                           eos_token_id=None, pad_token_id=0)
        seen = []
        streamer = SimpleNamespace(put=lambda v: seen.extend(v.reshape(-1).tolist()), end=lambda: seen.append("end"))
        got = ours.generate(prompt, max_new_tokens=40, prompt_lookup_num_tokens=k, eos_token_id=None,
                            streamer=streamer)
        assert torch.equal(got, want), k
        assert seen == got[0].tolist() + ["end"]


def test_prompt_lookup_settings_are_checked():
    from lmkit.errors import GenerationError

    model = CausalLM(get_preset("gpt2", d_model=16, n_layers=1, n_heads=2, vocab_size=20, max_seq_len=32)).eval()
    ids = torch.tensor([[1, 2, 3]])
    for bad, match in (({"prompt_lookup_num_tokens": 0}, "whole number"),
                       ({"prompt_lookup_num_tokens": 2.5}, "whole number"),
                       ({"prompt_lookup_num_tokens": 3, "max_matching_ngram_size": 0}, "whole number"),
                       ({"prompt_lookup_num_tokens": 3, "do_sample": True}, "greedy"),
                       ({"prompt_lookup_num_tokens": 3, "num_beams": 2}, "greedy")):
        with pytest.raises(GenerationError, match=match):
            model.generate(ids, max_new_tokens=4, **bad)


@torch.inference_mode()
def test_models_without_a_plan_check_drafts_through_their_forward(monkeypatch):
    """A model the lean step does not cover (here: its plan turned off) checks drafts through `forward` with the
    holed mask and positions: the same tokens."""
    from lmkit.generation.decode_plan import DecodePlan

    torch.manual_seed(0)
    model = CausalLM(get_preset("llama", d_model=32, n_layers=2, n_heads=4, n_kv_heads=2, vocab_size=40,
                                max_seq_len=128)).eval()
    ids, mask = _repeating_batch(3, 40, 4)
    want = model.generate(ids, attention_mask=mask, max_new_tokens=30)
    monkeypatch.setattr(DecodePlan, "build", classmethod(lambda cls, model, batch: None))
    calls = []
    forward = type(model).forward
    monkeypatch.setattr(type(model), "forward", lambda self, *a, **k: calls.append(a[0].shape[1]) or forward(self, *a, **k))
    got = model.generate(ids, attention_mask=mask, max_new_tokens=30, prompt_lookup_num_tokens=5)
    assert torch.equal(got, want) and max(calls[1:]) > 1
    with pytest.raises(GenerationError, match="does not know"):  # model keywords reach the model, as without drafts
        model.generate(ids, max_new_tokens=3, prompt_lookup_num_tokens=2, no_such_argument=1)


@torch.inference_mode()
def test_the_harness_with_no_new_tokens_returns_the_prompts():
    model = CausalLM(get_preset("gpt2", d_model=16, n_layers=1, n_heads=2, vocab_size=40, max_seq_len=64)).eval()
    ids, mask = _repeating_batch(2, 40, 1)
    assert torch.equal(harness_generate.generate_rows(_lm(model, None), ids, mask, 0, ["\n"], pad=0), ids)


def _window_end(rows: list[list[int]], width: int, stops: list[str], decode, max_new: int) -> int:
    """lm-eval's stop rule by its definition (one token a character here): the first step by which every row's last
    len(stop) + 2 columns (none before the prompt's end) have decoded to a text holding a stop; else the last step."""
    def shown(row, step):
        end = width + step + 1
        return any(s in decode(row[max(width, end - len(s) - 2):end]) for s in stops)

    for step in range(max_new):
        if all(any(shown(row, s) for s in range(step + 1)) for row in rows):
            return step
    return max_new - 1


@pytest.mark.parametrize("lookup", [False, True], ids=["one-token", "prompt-lookup"])
@torch.inference_mode()
def test_the_harness_stop_rule_ends_the_batch_where_every_row_has_stopped(lookup):
    """generate with lm-eval's stop rule (a whole-batch StopWindow): rows that have shown a stop string decode on
    until every row has, then the batch ends; with prompt-lookup drafts (rows running ahead of each other) too."""
    from lmkit.generation.stopping import StopWindow

    torch.manual_seed(0)
    model = CausalLM(get_preset("llama", d_model=32, n_layers=2, n_heads=4, n_kv_heads=2, vocab_size=40,
                                max_seq_len=128)).eval()
    ids, mask = _repeating_batch(3, 40, 2)
    lm = _lm(model, [])
    width = ids.shape[1]
    free = model.generate(ids, attention_mask=mask, max_new_tokens=24, eos_token_id=[])[:, width:].tolist()
    stops = [lm.tokenizer.decode([free[r][3 + 4 * r]]) for r in range(3)]  # rows meet them at different steps
    full = model.generate(ids, attention_mask=mask, max_new_tokens=24, eos_token_id=[]).tolist()
    end = _window_end(full, width, stops, lm.tokenizer.decode, 24)
    assert 3 <= end < 23
    extra = dict(prompt_lookup_num_tokens=MAX_DRAFT, max_matching_ngram_size=3) if lookup else {}
    got = model.generate(ids, attention_mask=mask, max_new_tokens=24, eos_token_id=[],
                         stopping_criteria=[StopWindow(lm.tokenizer, stops, width)], **extra)
    assert got.tolist() == [row[:width + end + 1] for row in full]
    if lookup:  # the harness decodes this way
        assert torch.equal(harness_generate.generate_rows(lm, ids, mask, 24, stops, pad=0), got)


@torch.inference_mode()
def test_the_harness_stops_a_row_at_any_id_of_an_end_id_list():
    """A folder whose generation_config.json lists several end ids: the harness's rows stop at whichever comes."""
    torch.manual_seed(0)
    model = CausalLM(get_preset("gpt2", d_model=32, n_layers=2, n_heads=4, vocab_size=40, max_seq_len=96)).eval()
    ids, mask = _repeating_batch(3, 40, 3)
    width = ids.shape[1]
    free = model.generate(ids, attention_mask=mask, max_new_tokens=20, eos_token_id=[])[:, width:].tolist()
    ends = [free[0][2], free[2][6]]
    got = harness_generate.generate_rows(_lm(model, ends), ids, mask, 20, [], pad=0)
    assert torch.equal(got, model.generate(ids, attention_mask=mask, max_new_tokens=20, eos_token_id=ends,
                                           pad_token_id=0))
    for r, row in enumerate(got[:, width:].tolist()):
        hits = [i for i, t in enumerate(free[r]) if t in ends]
        if hits:  # the row stopped at its first end id, whichever of the list it was, and padded after it
            assert row[:hits[0] + 1] == free[r][:hits[0] + 1] and set(row[hits[0] + 1:]) <= {0}
    assert any(t in ends for t in got[0, width:width + 3].tolist())


@pytest.mark.parametrize("family", ["llama", "gpt2"])
@torch.inference_mode()
def test_prompts_read_without_their_padding_decode_the_same_tokens(family):
    """generate(prefill_unpadded=True), the harness's prefill: prompts of each length read together without padding,
    then the same tokens as the padded prefill, with and without prompt lookup, and the same next-token logits."""
    torch.manual_seed(0)
    config = get_preset(family, d_model=32, n_layers=2, n_heads=4, vocab_size=40, max_seq_len=96,
                        **({"n_kv_heads": 2} if family == "llama" else {}))
    model = CausalLM(config).eval()
    ids, mask = _repeating_batch(4, 40, 5)
    for extra in (dict(), dict(prompt_lookup_num_tokens=4)):
        want = model.generate(ids, attention_mask=mask, max_new_tokens=20, eos_token_id=[], **extra)
        got = model.generate(ids, attention_mask=mask, max_new_tokens=20, eos_token_id=[], prefill_unpadded=True,
                             **extra)
        assert torch.equal(got, want), extra
    padded = model.prepare_generation(ids, mask)
    unpadded = model.prepare_generation(ids, mask, prefill_unpadded=True)
    first = model.generation_logits(padded[1], ids)
    torch.testing.assert_close(model.generation_logits(unpadded[1], ids), first, atol=1e-5, rtol=1e-5)
    assert unpadded[1].cache.get_seq_length() == padded[1].cache.get_seq_length() == ids.shape[1]
