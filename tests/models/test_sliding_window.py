"""Sliding-window attention, on every layer (Mistral, Mixtral) or on some (Qwen2), against transformers 5.

Prompts of 3, 9 and 17 tokens left-padded into one batch (and one row alone), a window of 5 and 20 new
tokens, so both the prompt and the generation run past the window: logits, greedy ids, seeded sampled
ids and beam search equal transformers' `generate` with its own cache (DynamicSlidingWindowLayer keeps the
last W - 1 keys and offsets its padding mask) and equal lmkit without DecodePlan. Mixed Qwen2 folders
save back to a config.json that transformers reads the same way in its 5.x (`layer_types`) and 4.x
(`max_window_layers`) spellings; formats with one window for all layers refuse a mixed model.
"""
import json

import pytest
import torch

import lmkit
from lmkit.config import ModelConfig, get_preset
from lmkit.errors import ConfigError
from lmkit.generation.decode_plan import DecodePlan
from lmkit.models import build_model
from helpers.hub_pairs import VOCAB, randomized

transformers = pytest.importorskip("transformers")
transformers.logging.set_verbosity_error()
from transformers import (AutoModelForCausalLM, MistralConfig, MistralForCausalLM, MixtralConfig,  # noqa: E402
                          MixtralForCausalLM, Qwen2Config, Qwen2ForCausalLM)

SMALL = dict(vocab_size=VOCAB, num_hidden_layers=3, max_position_embeddings=64, bos_token_id=1, eos_token_id=2,
             hidden_size=32, intermediate_size=40, num_attention_heads=4, num_key_value_heads=2)
CASES = {
    "mistral-window5": lambda: MistralForCausalLM(MistralConfig(sliding_window=5, **SMALL)),
    "qwen2-layers-1-2-slide-5": lambda: Qwen2ForCausalLM(Qwen2Config(
        use_sliding_window=True, sliding_window=5, max_window_layers=1, **SMALL)),
    "qwen2-layers-0-2-slide-5": lambda: Qwen2ForCausalLM(Qwen2Config(  # 5.x only: not a suffix of the layers
        use_sliding_window=True, sliding_window=5, layer_types=["sliding_attention", "full_attention",
                                                                "sliding_attention"], **SMALL)),
    "mixtral-window5": lambda: MixtralForCausalLM(MixtralConfig(sliding_window=5, num_local_experts=3, **SMALL)),
}
LENGTHS = (3, 9, 17)


@pytest.fixture(scope="module", params=list(CASES))
def pair(request, tmp_path_factory):
    torch.manual_seed(0)
    hf = randomized(CASES[request.param]())
    folder = tmp_path_factory.mktemp(request.param)
    hf.save_pretrained(folder)
    return hf, lmkit.load_model(folder)


def prompts() -> tuple[torch.Tensor, torch.Tensor]:
    """Rows of 3, 9 and 17 tokens, left-padded to 17."""
    ids = torch.randint(3, VOCAB, (len(LENGTHS), max(LENGTHS)), generator=torch.Generator().manual_seed(1))
    mask = torch.zeros_like(ids)
    for row, n in enumerate(LENGTHS):
        mask[row, -n:] = 1
    return ids, mask


def test_the_layers_slide_as_in_transformers(pair):
    hf, ours = pair
    windows = [getattr(layer.self_attn, "sliding_window", hf.config.sliding_window) for layer in hf.model.layers]
    assert [ours.config.layer_window(i) for i in range(3)] == windows


def test_logits_of_inputs_longer_than_the_window_match(pair):
    hf, ours = pair
    ids, mask = prompts()
    with torch.no_grad():
        for m in (None, mask):  # padded rows included
            torch.testing.assert_close(ours(ids, attention_mask=m).logits, hf(ids, attention_mask=m).logits,
                                       atol=1e-4, rtol=0)


@pytest.mark.parametrize("options", [dict(), dict(do_sample=True, top_k=0), dict(do_sample=True, top_k=20),
                                     dict(num_beams=3), dict(num_beams=2, do_sample=True)],
                         ids=["greedy", "sampled", "sampled-top-k", "beams", "beam-sampling"])
def test_generation_past_the_window_matches_transformers_cached_generate(pair, options, monkeypatch):
    hf, ours = pair
    ids, mask = prompts()
    common = dict(max_new_tokens=20, pad_token_id=0, **options)
    for rows, m in ((ids, mask), (ids[2:], None)):
        torch.manual_seed(3)
        want = hf.generate(rows, attention_mask=m, eos_token_id=None, **common)  # with transformers' cache
        torch.manual_seed(3)
        got = ours.generate(rows, attention_mask=m, eos_token_id=[], **common)
        assert got.tolist() == want.tolist()
        with monkeypatch.context() as patch:  # the modules' cached steps choose the same ids as DecodePlan's
            patch.setattr(DecodePlan, "build", classmethod(lambda cls, model, batch: None))
            torch.manual_seed(3)
            assert ours.generate(rows, attention_mask=m, eos_token_id=[], **common).tolist() == want.tolist()


def test_dense_sliding_models_decode_through_the_plan(pair):
    hf, ours = pair
    assert (DecodePlan.build(ours, 3) is not None) == (hf.config.model_type != "mixtral")  # experts: modules


def mixed_qwen2(sliding_layers: list[int]) -> torch.nn.Module:
    torch.manual_seed(4)
    model = build_model(get_preset("llama", vocab_size=VOCAB, d_model=32, n_layers=4, n_heads=4, n_kv_heads=2,
                                   attention_bias=True, attention_out_bias=False, sliding_window=3,
                                   sliding_layers=sliding_layers, family="qwen2", init_std=0.2, max_seq_len=64))
    return model.eval()


@pytest.mark.parametrize("sliding_layers", [[2, 3], [0, 2]], ids=["last-layers", "alternating"])
def test_mixed_qwen2_saves_to_a_config_transformers_reads_the_same_way(sliding_layers, tmp_path):
    ours = mixed_qwen2(sliding_layers)
    ours.save_pretrained(tmp_path)
    raw = json.loads((tmp_path / "config.json").read_text())
    assert raw["use_sliding_window"] and raw["sliding_window"] == 3 and raw["max_window_layers"] == sliding_layers[0]
    assert raw["layer_types"] == ["sliding_attention" if i in sliding_layers else "full_attention" for i in range(4)]
    ids, mask = prompts()
    styles = [raw]
    if sliding_layers == [2, 3]:  # 4.x spelling: max_window_layers alone says the same of the last layers
        v4 = dict(raw)
        v4.pop("layer_types")
        styles.append(v4)
    with torch.no_grad():
        want = ours(ids, attention_mask=mask).logits
        for style in styles:
            (tmp_path / "config.json").write_text(json.dumps(style))
            theirs = AutoModelForCausalLM.from_pretrained(tmp_path).eval()
            assert [layer.self_attn.sliding_window for layer in theirs.model.layers] == \
                [3 if i in sliding_layers else None for i in range(4)]
            torch.testing.assert_close(theirs(ids, attention_mask=mask).logits, want, atol=1e-4, rtol=0)
            back = lmkit.load_model(tmp_path).config
            assert (back.sliding_window, back.sliding_layers) == (3, sliding_layers)


def test_sliding_layers_round_trip_through_lmkits_own_format(tmp_path):
    ours = mixed_qwen2([1])
    ours.config.family = None
    ours.save_pretrained(tmp_path)
    back = lmkit.load_model(tmp_path)
    assert back.config.sliding_layers == [1] and back.config == ours.config
    ids, mask = prompts()
    with torch.no_grad():
        torch.testing.assert_close(back(ids, attention_mask=mask).logits, ours(ids, attention_mask=mask).logits)


@pytest.mark.parametrize("family", ["mistral", "mixtral"])
def test_formats_with_one_window_for_all_layers_refuse_a_mixed_model(family, tmp_path):
    experts = dict(n_experts=2) if family == "mixtral" else {}
    model = build_model(get_preset("llama", vocab_size=64, d_model=32, n_layers=2, n_heads=4, n_kv_heads=2,
                                   sliding_window=4, sliding_layers=[1], family=family, **experts))
    with pytest.raises(ConfigError, match="slides every layer or none.*family='qwen2'"):
        model.save_pretrained(tmp_path)
    assert not (tmp_path / "config.json").exists()


@pytest.mark.parametrize("changes, message", [
    (dict(sliding_layers=[1]), "needs sliding_window"),
    (dict(sliding_window=4, sliding_layers=[2]), "0..1"),
    (dict(sliding_window=4, sliding_layers=[1, 0]), "increasing"),
    (dict(sliding_window=4, sliding_layers=[0, 0]), "distinct"),
    (dict(sliding_window=4, sliding_layers="0"), "sliding_layers='0' is not of type"),
])
def test_bad_sliding_layers_are_refused(changes, message):
    with pytest.raises(ConfigError, match=message):
        ModelConfig(n_layers=2, **changes)


def test_a_distilled_student_keeps_the_windows_of_the_layers_it_keeps():
    from lmkit.compress.distill import student_from_teacher

    teacher = mixed_qwen2([2, 3])  # keeps layers 0 and 2: layer 1 of the student slides
    student = student_from_teacher(teacher, every=2)
    assert (student.config.sliding_window, student.config.sliding_layers) == (3, [1])
    assert (student_from_teacher(mixed_qwen2([1, 3]), every=2).config.sliding_window) is None  # no kept layer slides
