"""The continuous-batching engine: 16 requests of mixed prompt lengths, settings and stop strings, run together
(joining and leaving between steps, prompts prefilled in small chunks), give exactly the ids model.generate gives
each of them run alone (seeded requests: torch.manual_seed(seed) before generate)."""
import pytest
import torch

import lmkit
from lmkit.errors import GenerationError
from lmkit.generation import GenerationConfig
from lmkit.generation.engine import Engine, Request

pytest.importorskip("transformers")
from serving_folders import make_folder  # noqa: E402

SETTINGS = [dict(), dict(do_sample=True, top_k=0), dict(do_sample=True, temperature=0.7, top_p=0.9),
            dict(repetition_penalty=1.3), dict(do_sample=True, top_k=8, min_p=0.05), dict(no_repeat_ngram_size=2),
            dict(do_sample=True, temperature=1.3, repetition_penalty=1.1), dict(min_new_tokens=5)]


@pytest.fixture(scope="module", params=["gpt2", "llama"])
def loaded(request, tmp_path_factory):
    folder = make_folder(tmp_path_factory.mktemp(request.param), request.param)
    return lmkit.load_model(folder), lmkit.load_tokenizer(folder)


def _requests(tok, vocab):
    gen = torch.Generator().manual_seed(1)
    out = []
    for i in range(16):
        length = int(torch.randint(1, 40, (), generator=gen))
        prompt = torch.randint(0, vocab, (length,), generator=gen).tolist()
        settings = dict(SETTINGS[i % len(SETTINGS)], max_new_tokens=int(torch.randint(3, 25, (), generator=gen)))
        if i % 3 == 0:  # stop strings: ones that the output is likely to hold, decoded across token boundaries
            settings["stop_strings"] = ["e", "th", "o w"]
        out.append(Request(prompt=prompt, config=GenerationConfig(**settings), seed=100 + i, tokenizer=tok))
    return out


def _alone(model, tok, request):
    if request.seed is not None:
        torch.manual_seed(request.seed)
    ids = model.generate(torch.tensor([request.prompt]), generation_config=request.config, tokenizer=tok)
    return ids[0, len(request.prompt):].tolist()


def test_concurrent_requests_equal_generate_alone(loaded):
    model, tok = loaded
    requests = _requests(tok, model.config.vocab_size)
    engine = Engine(model, max_batch=5, prefill_chunk=7)  # fewer slots than requests: they queue, join and leave
    engine.run_all(requests)
    stopped = 0
    for request in requests:
        assert request.output == _alone(model, tok, request), request.config
        stopped += request.finish_reason == "stop"
        assert request.finish_reason in ("stop", "length")
    assert stopped  # at least one stop string or EOS really ended a request early
    assert engine.free == list(range(5)) and not engine.running


def test_requests_joining_mid_run_and_cancelled_ones_free_their_slots(loaded):
    model, tok = loaded
    engine = Engine(model, max_batch=2, prefill_chunk=4)
    first = engine.submit(Request(prompt=[5, 6, 7], config=GenerationConfig(max_new_tokens=30)))
    doomed = engine.submit(Request(prompt=[8, 9], config=GenerationConfig(max_new_tokens=30)))
    for _ in range(4):
        engine.step()
    engine.cancel(doomed)
    late = engine.submit(Request(prompt=list(range(20, 31)), config=GenerationConfig(max_new_tokens=6)))
    engine.step()  # the cancelled request leaves and the late one takes its slot in the same step
    assert doomed.finish_reason == "cancelled" and late.slot == doomed.slot
    while not (first.finished and late.finished):
        engine.step()
    assert late.output == _alone(model, tok, late) and first.output == _alone(model, tok, first)


def test_requests_left_running_move_down_to_consecutive_slots(loaded):
    """When low slots finish first, the requests above move into them (their keys and values with them), so a
    step's rows are consecutive slots, and every request still decodes generate's ids."""
    model, tok = loaded
    lengths = [2, 9, 4, 12, 3, 10]  # new tokens: slots 0, 2 and 4 finish first
    requests = [Request(prompt=[5 + i, 7, 11 + 2 * i][: 1 + i % 3], seed=i, config=GenerationConfig(
        do_sample=True, top_k=0, max_new_tokens=n, eos_token_id=[])) for i, n in enumerate(lengths)]
    engine = Engine(model, max_batch=6)
    seen, decode = [], engine._decode

    def watched(rows):  # the slots of each decoding step's rows
        seen.append([r.slot for r in rows])
        decode(rows)

    engine._decode = watched
    engine.run_all(requests)
    assert [1, 3, 5] not in seen and [0, 1, 2] in seen  # the three long ones moved down rather than stayed up
    assert all(slots == list(range(len(slots))) for slots in seen)
    for request in requests:
        assert request.output == _alone(model, tok, request)
    assert engine.free == list(range(6))


def test_prompt_logprobs_are_the_models_log_softmax(loaded):
    model, _ = loaded
    prompt = list(range(3, 40))
    request = Request(prompt=prompt, prompt_logprobs=3, score_only=True)
    Engine(model, prefill_chunk=10).run_all([request])
    with torch.no_grad():
        reference = torch.log_softmax(model(torch.tensor([prompt])).logits[0].float(), -1)
    assert request.prompt_token_logprobs[0] is None
    expected = reference[torch.arange(len(prompt) - 1), torch.tensor(prompt[1:])]
    assert torch.allclose(torch.tensor(request.prompt_token_logprobs[1:]), expected, atol=1e-5)
    for i, top in enumerate(request.prompt_top_logprobs[1:]):
        assert prompt[i + 1] in top and max(top.values()) == pytest.approx(float(reference[i].max()), abs=1e-5)


def test_engine_refuses_what_it_cannot_decode(loaded):
    model, _ = loaded
    engine = Engine(model)
    with pytest.raises(GenerationError, match="group"):  # n samples are n requests (beams: test_engine_beams.py)
        engine.prepare(Request(prompt=[1, 2], config=GenerationConfig(num_return_sequences=2, do_sample=True)))
    with pytest.raises(GenerationError, match="tokenizer"):
        engine.prepare(Request(prompt=[1, 2], config=GenerationConfig(stop_strings=["x"])))
    with pytest.raises(GenerationError, match="empty"):
        engine.prepare(Request(prompt=[]))


GROUP_SETTINGS = [dict(do_sample=True, top_k=0), dict(do_sample=True, temperature=0.8, top_p=0.9, stop_strings=["e"]),
                  dict(do_sample=True, top_k=10, repetition_penalty=1.2, min_new_tokens=3, stop_strings=["a", "o"])]


def test_a_group_gives_the_rows_of_generate_num_return_sequences(loaded):
    """n requests of one prompt prepared as a group, decoded beside others and prefilled in chunks, give the n rows
    model.generate(num_return_sequences=n) gives after torch.manual_seed(seed), members that stop early included."""
    model, tok = loaded
    prompt = torch.randint(0, model.config.vocab_size, (11,), generator=torch.Generator().manual_seed(3)).tolist()
    stopped_early = 0
    for k, settings in enumerate(GROUP_SETTINGS):
        config = GenerationConfig(max_new_tokens=14, **settings)
        members = [Request(prompt=prompt, config=config, seed=40 + k, tokenizer=tok) for _ in range(3)]
        engine = Engine(model, max_batch=6, prefill_chunk=5)
        engine.prepare_group(members)
        others = _requests(tok, model.config.vocab_size)[k:k + 4]
        engine.run_all(others[:2] + members + others[2:])
        torch.manual_seed(40 + k)
        rows = model.generate(torch.tensor([prompt]), generation_config=config, num_return_sequences=3, tokenizer=tok)
        for member, row in zip(members, rows[:, len(prompt):].tolist()):
            assert member.output == row[:len(member.output)], settings
            assert len(set(row[len(member.output):])) <= 1  # generate pads a row that finished early
            stopped_early += len(member.output) < len(row)
        assert all(r.output == _alone(model, tok, r) for r in others)
        assert engine.free == list(range(6))
    assert stopped_early  # a member finished before the others: its draws were still made


def test_a_group_larger_than_the_batch_is_refused(loaded):
    model, _ = loaded
    engine = Engine(model, max_batch=2)
    members = [Request(prompt=[1, 2], config=GenerationConfig(do_sample=True)) for _ in range(3)]
    with pytest.raises(GenerationError, match="lower n"):
        engine.prepare_group(members)


def test_a_list_of_end_ids_stops_a_request_at_any_of_them(loaded):
    """generation_config.json lists, or a server's stop ids (its EOS and the chat template's end of turn): a request
    stops at the first of its output's tokens that is in the list, as generate stops, whichever id it is."""
    model, tok = loaded
    prompt = [5, 9, 13, 2, 7]
    free = model.generate(torch.tensor([prompt]), max_new_tokens=12, eos_token_id=[])[0, len(prompt):].tolist()
    for ends in ([free[6], free[2]], [free[2], free[6]], [model.config.vocab_size + 5, free[4]]):
        first = min(free.index(e) for e in ends if e in free)
        config = GenerationConfig(max_new_tokens=12, eos_token_id=ends)
        engine = Engine(model, max_batch=2)
        request, other = engine.run_all([Request(prompt=prompt, config=config),
                                         Request(prompt=prompt[:3], config=GenerationConfig(max_new_tokens=12))])
        assert request.output == free[:first + 1] and request.finish_reason == "stop", ends
        alone = model.generate(torch.tensor([prompt]), generation_config=config)
        assert request.output == alone[0, len(prompt):].tolist()
        assert len(other.output) == 12 or other.finish_reason == "stop"  # its own (the folder's) end ids only
