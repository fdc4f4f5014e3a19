"""Sliding-window attention in the serving engine: Mistral (every layer slides), Qwen2 with only some layers
sliding, and Mixtral (experts: decoded through the modules, not the lean plan), with a window of 5 below most
prompts and outputs. Requests of mixed settings run together, prefilled in chunks of 4 that cross the window's
edge, and give the tokens and log-probabilities `generate` gives each alone (seeded ones after
torch.manual_seed(seed))."""
import pytest
import torch

import lmkit
from lmkit.generation import GenerationConfig
from lmkit.generation.engine import Engine, Request
from helpers.hub_pairs import VOCAB, randomized

transformers = pytest.importorskip("transformers")
transformers.logging.set_verbosity_error()

SMALL = dict(vocab_size=VOCAB, num_hidden_layers=3, max_position_embeddings=64, bos_token_id=1, eos_token_id=2,
             hidden_size=32, intermediate_size=40, num_attention_heads=4, num_key_value_heads=2)
CASES = {
    "mistral": lambda: transformers.MistralForCausalLM(transformers.MistralConfig(sliding_window=5, **SMALL)),
    "qwen2-layers-0-2": lambda: transformers.Qwen2ForCausalLM(transformers.Qwen2Config(
        use_sliding_window=True, sliding_window=5, layer_types=["sliding_attention", "full_attention",
                                                                "sliding_attention"], **SMALL)),
    "mixtral": lambda: transformers.MixtralForCausalLM(transformers.MixtralConfig(sliding_window=5, num_local_experts=3,
                                                                                  **SMALL)),
}
SETTINGS = [dict(), dict(do_sample=True, top_k=0), dict(repetition_penalty=1.3),
            dict(do_sample=True, temperature=0.8, top_p=0.9), dict(min_new_tokens=4)]


@pytest.fixture(scope="module", params=sorted(CASES))
def model(request, tmp_path_factory):
    folder = tmp_path_factory.mktemp(request.param)
    torch.manual_seed(0)
    randomized(CASES[request.param]()).save_pretrained(folder)
    loaded = lmkit.load_model(folder)
    assert loaded.config.sliding_window == 5
    return loaded


def _alone(model, request):
    """generate's new tokens for `request` alone and the log-probability of each under the model's raw logits."""
    if request.seed is not None:
        torch.manual_seed(request.seed)
    out = model.generate(torch.tensor([request.prompt]), generation_config=request.config,
                         return_dict_in_generate=True, output_logits=True)
    tokens = out.sequences[0, len(request.prompt):].tolist()
    logprobs = [float(torch.log_softmax(step[0], -1)[t]) for step, t in zip(out.logits, tokens)]
    return tokens, logprobs


def test_engine_equals_generate_past_the_window(model):
    gen = torch.Generator().manual_seed(5)
    requests = []
    for i in range(7):
        prompt = torch.randint(3, VOCAB, (int(torch.randint(1, 19, (), generator=gen)),), generator=gen).tolist()
        config = GenerationConfig(max_new_tokens=int(torch.randint(6, 14, (), generator=gen)),
                                  **SETTINGS[i % len(SETTINGS)])
        requests.append(Request(prompt=prompt, config=config, seed=20 + i, logprobs=0))
    engine = Engine(model, max_batch=3, prefill_chunk=4)  # requests queue, and prompts prefill 4 tokens a step
    engine.run_all(requests)
    assert any(len(r.prompt) + len(r.output) > 12 for r in requests)  # well past the window of 5
    for request in requests:
        tokens, logprobs = _alone(model, request)
        assert request.output == tokens, request.config
        assert request.token_logprobs == pytest.approx(logprobs, abs=1e-4)


def test_window_changes_what_the_engine_decodes(model):
    """The windows are really applied: the same weights with full attention give other logits."""
    prompt = list(range(3, 20))
    windowed = Request(prompt=prompt, config=GenerationConfig(max_new_tokens=4), logprobs=0)
    Engine(model, max_batch=2).run_all([windowed])
    full = lmkit.models.build_model(model.config.replace(sliding_window=None, sliding_layers=None))
    full.load_state_dict(model.state_dict())
    plain = Request(prompt=prompt, config=GenerationConfig(max_new_tokens=4), logprobs=0)
    Engine(full.eval(), max_batch=2).run_all([plain])
    assert windowed.token_logprobs != pytest.approx(plain.token_logprobs, abs=1e-4)
