"""Beam search through the serving engine: for a LLaMA, a T5 v1.1 and a BART model, and the beam settings the
beam-search tests check against transformers (length penalties of both signs, early_stopping True, False and
"never", n-gram blocking, min_new_tokens, several hypotheses returned), two beam requests of different prompts
decoding beside a plain request give the hypotheses `generate` gives each prompt alone, with end tokens on the
beams' own paths so that hypotheses finish at different lengths."""
import pytest
import torch

from lmkit.errors import GenerationError
from lmkit.generation import GenerationConfig
from lmkit.generation.engine import Engine, Request

transformers = pytest.importorskip("transformers")

from helpers.beams import IDS, SETTINGS, V, peaky  # noqa: E402
from helpers.hub_pairs import saved_pair  # noqa: E402
from helpers.seq2seq_pairs import MODELS  # noqa: E402


def _llama():
    return transformers.LlamaForCausalLM(transformers.LlamaConfig(
        vocab_size=V, hidden_size=24, intermediate_size=40, num_hidden_layers=2, num_attention_heads=4,
        num_key_value_heads=2, max_position_embeddings=64, bos_token_id=1, eos_token_id=2))


@pytest.fixture(scope="module", params=["llama", "t5-v1.1", "bart"])
def model(request, tmp_path_factory):
    torch.manual_seed(4)
    if request.param == "llama":
        return saved_pair(peaky(_llama().eval(), 3.0), "llama", tmp_path_factory)[1]
    name, build, scale = next(m for m in MODELS if m[0] == request.param)
    return saved_pair(peaky(build().eval(), scale), name, tmp_path_factory)[1]


def _generated(model, prompt, config):
    """generate's hypotheses for `prompt` alone, each without the padding after it (and the decoder start)."""
    rows = model.generate(torch.tensor([prompt]), generation_config=config)
    skip = len(prompt) if model.config.architecture == "decoder" else 1
    pad = config.pad_token_id
    return [row[skip:].tolist() for row in rows], pad


@pytest.mark.parametrize("setting", SETTINGS, ids=IDS)
def test_beams_through_the_engine_equal_generate(model, setting):
    vocab = model.config.vocab_size
    prompts = [[5, 9, 12, 7], [8, 4, 11, 6, 3, 10, 13]]
    free = model.generate(torch.tensor([prompts[0]]), max_new_tokens=8, eos_token_id=[], pad_token_id=1,
                          **{k: v for k, v in setting.items() if k != "num_return_sequences"})
    path = free[0, -8:].tolist()  # end tokens on the beams' own path, so that some hypotheses finish early
    eos = [t for t in dict.fromkeys((path[2], path[5])) if t > 2][:2] or [vocab - 1]
    config = GenerationConfig(max_new_tokens=8, eos_token_id=eos, pad_token_id=1, **setting)
    beams = [Request(prompt=p, config=config) for p in prompts]
    plain = Request(prompt=[6, 6, 3], config=GenerationConfig(max_new_tokens=5))
    engine = Engine(model, max_batch=12, prefill_chunk=5)
    engine.run_all([beams[0], plain, beams[1]])
    finished_early = False
    for request, prompt in zip(beams, prompts):
        expected, pad = _generated(model, prompt, config)
        width = len(expected[0])
        assert [b + [pad] * (width - len(b)) for b in request.beams] == expected, setting
        assert request.output == request.beams[0]
        finished_early |= any(len(b) < 8 for b in request.beams)
    if setting is SETTINGS[0]:
        assert finished_early  # some hypothesis ended at an end token
    assert sorted(engine.free) == list(range(12)) and not engine.running


def test_beam_requests_that_the_engine_cannot_run_are_refused(model):
    engine = Engine(model, max_batch=3)
    with pytest.raises(GenerationError, match="slots"):
        engine.prepare(Request(prompt=[4, 5], config=GenerationConfig(num_beams=4)))
    with pytest.raises(GenerationError, match="sampling"):
        engine.prepare(Request(prompt=[4, 5], config=GenerationConfig(num_beams=2, do_sample=True)))
    with pytest.raises(GenerationError, match="alone"):
        engine.prepare_group([Request(prompt=[4, 5], config=GenerationConfig(num_beams=2)) for _ in range(2)])
