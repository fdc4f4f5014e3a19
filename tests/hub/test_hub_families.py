"""Mistral and Qwen2 folders: lmkit against transformers on small random models of odd shapes.

GQA and MQA, head_dim apart from hidden_size / heads, tied and untied embeddings, RoPE scaling, sliding
windows: logits agree within 1e-4 (padded rows included), greedy generation is equal with and without left
padding, cached decoding (DecodePlan where it applies) equals full recomputation, folders lmkit writes
(single, sharded, bf16) load in transformers with the same logits, transformers 4.x-style config.json loads
the same model, `lmkit generate` runs on such a folder, and what lmkit cannot express is one clear error.
"""
import json
import os
import subprocess
import sys
from pathlib import Path

import pytest
import torch

import lmkit
from lmkit.errors import ConfigError
from lmkit.generation.decode_plan import DecodePlan
from test_hub_decoder import VOCAB, as_v4, batch, check_greedy, check_logits, check_saved_folder, check_sharded_folder, \
    randomized, rewrite_config, saved_pair
from tolerances import assert_close_in

transformers = pytest.importorskip("transformers")
transformers.logging.set_verbosity_error()
from transformers import (AutoModelForCausalLM, MistralConfig, MistralForCausalLM, Qwen2Config,  # noqa: E402
                          Qwen2ForCausalLM)

SMALL = dict(vocab_size=VOCAB, num_hidden_layers=2, max_position_embeddings=64, bos_token_id=1, eos_token_id=2)
CASES = {
    "mistral-gqa-headdim10-window5-untied": lambda: MistralForCausalLM(MistralConfig(
        hidden_size=36, intermediate_size=44, num_attention_heads=6, num_key_value_heads=2, head_dim=10,
        sliding_window=5, rope_theta=500.0, **SMALL)),
    "mistral-mqa-tied-linear-nowindow": lambda: MistralForCausalLM(MistralConfig(
        hidden_size=32, intermediate_size=40, num_attention_heads=4, num_key_value_heads=1, sliding_window=None,
        tie_word_embeddings=True, rope_parameters={"rope_type": "linear", "factor": 2.0, "rope_theta": 10000.0},
        **SMALL)),
    "qwen2-gqa-tied-yarn": lambda: Qwen2ForCausalLM(Qwen2Config(
        hidden_size=40, intermediate_size=36, num_attention_heads=4, num_key_value_heads=2, tie_word_embeddings=True,
        rope_parameters={"rope_type": "yarn", "factor": 4.0, "original_max_position_embeddings": 16,
                         "rope_theta": 1000.0}, **SMALL)),
    "qwen2-mqa-untied-headdim14-llama3": lambda: Qwen2ForCausalLM(Qwen2Config(
        hidden_size=24, intermediate_size=52, num_attention_heads=3, num_key_value_heads=1, head_dim=14,
        rope_parameters={"rope_type": "llama3", "factor": 8.0, "low_freq_factor": 1.0, "high_freq_factor": 4.0,
                         "original_max_position_embeddings": 16, "rope_theta": 10000.0}, **SMALL)),
    "qwen2-every-layer-slides-4": lambda: Qwen2ForCausalLM(Qwen2Config(
        hidden_size=32, intermediate_size=40, num_attention_heads=4, num_key_value_heads=4, use_sliding_window=True,
        sliding_window=4, max_window_layers=0, **SMALL)),
    "qwen2-layers-1-2-of-3-slide-3": lambda: Qwen2ForCausalLM(Qwen2Config(  # sliding and full layers mixed
        hidden_size=32, intermediate_size=40, num_attention_heads=4, num_key_value_heads=2, use_sliding_window=True,
        sliding_window=3, max_window_layers=1, **{**SMALL, "num_hidden_layers": 3})),
}


def hf_model(name: str):
    torch.manual_seed(0)
    return randomized(CASES[name]())


@pytest.fixture(scope="module", params=list(CASES))
def pair(request, tmp_path_factory):
    return saved_pair(hf_model(request.param), request.param, tmp_path_factory)


def test_config_reads_the_family(pair):
    hf, ours, _ = pair
    cfg = hf.config
    assert ours.config.family == cfg.model_type
    assert (ours.config.resolved_head_dim, ours.config.resolved_n_kv_heads, ours.config.tie_embeddings) == \
        (hf.model.layers[0].self_attn.head_dim, cfg.num_key_value_heads, cfg.tie_word_embeddings)
    assert [ours.config.layer_window(i) for i in range(cfg.num_hidden_layers)] == \
        [getattr(layer.self_attn, "sliding_window", cfg.sliding_window) for layer in hf.model.layers]  # Qwen2's per layer
    attn = ours.decoder.layers[0].self_attn.sublayer
    qwen = cfg.model_type == "qwen2"
    assert (attn.q_proj.bias is not None, attn.v_proj.bias is not None, attn.o_proj.bias is not None) == (qwen, qwen, False)


def test_logits_match_transformers_with_and_without_padding(pair):
    check_logits(*pair[:2])


def test_greedy_generation_matches_transformers_with_and_without_left_padding(pair):
    check_greedy(*pair[:2])


def test_cached_decoding_equals_full_recomputation(pair):
    """generate's cached steps (DecodePlan where the model allows one) choose what full forwards choose,
    padded rows included; the plan covers sliding windows too."""
    _, ours, _ = pair
    ids, left, _ = batch()
    assert DecodePlan.build(ours, 3) is not None
    for mask in (None, left):
        got = ours.generate(ids, attention_mask=mask, max_new_tokens=12, pad_token_id=0)
        seq, m = ids, mask if mask is not None else torch.ones_like(ids)
        with torch.no_grad():
            for _ in range(12):
                positions = (m.cumsum(-1) - 1).clamp(min=0)
                nxt = ours(seq, attention_mask=m, position_ids=positions).logits[:, -1:].argmax(-1)
                seq, m = torch.cat([seq, nxt], 1), torch.cat([m, torch.ones_like(nxt)], 1)
        assert got.tolist() == seq.tolist()


def test_saved_folder_loads_in_transformers_with_the_same_logits(pair, tmp_path):
    hf, ours, _ = pair
    check_saved_folder(hf, ours, tmp_path)


def test_sharded_folder_round_trips(pair, tmp_path):
    hf, ours, _ = pair
    check_sharded_folder(hf, ours, tmp_path)


def as_v4_family(raw: dict) -> None:
    """transformers 4.x spelling: rope_theta/rope_scaling, torch_dtype, and (Qwen2) no layer_types list."""
    as_v4(raw)
    raw["torch_dtype"] = raw.pop("dtype", "float32")
    raw.pop("layer_types", None)
    if raw["model_type"] == "qwen2" and not raw["use_sliding_window"]:
        raw["sliding_window"] = 4096  # 4.x configs keep the number beside use_sliding_window: false


@pytest.mark.parametrize("name", list(CASES))
def test_v4_and_v5_style_configs_give_the_same_model(name, tmp_path):
    hf = hf_model(name)
    hf.save_pretrained(tmp_path)
    ids, left, _ = batch()
    with torch.no_grad():
        expected = hf(ids, attention_mask=left).logits
        v5 = lmkit.load_model(tmp_path)
        rewrite_config(tmp_path, as_v4_family)
        v4 = lmkit.load_model(tmp_path)
        assert v4.config == v5.config
        torch.testing.assert_close(v4(ids, attention_mask=left).logits, expected, atol=1e-4, rtol=0)


@pytest.mark.bf16
@pytest.mark.parametrize("name", ["mistral-gqa-headdim10-window5-untied", "qwen2-gqa-tied-yarn"])
def test_bfloat16_folders_load_and_save_in_bfloat16(name, tmp_path):
    hf_model(name).to(torch.bfloat16).save_pretrained(tmp_path / "hf")
    theirs = AutoModelForCausalLM.from_pretrained(tmp_path / "hf").eval()
    assert theirs.dtype == torch.bfloat16
    ids, left, _ = batch()
    ours = lmkit.load_model(tmp_path / "hf", dtype="auto")
    assert ours.dtype == torch.bfloat16
    with torch.no_grad():
        expected = theirs(ids, attention_mask=left).logits.float()
        # both round every op to bf16, in different orders: a few bf16 steps at the scale of the largest logit
        assert_close_in(torch.bfloat16, ours(ids, attention_mask=left).logits, expected, steps=4)
        ours.save_pretrained(tmp_path / "lm")
        assert json.loads((tmp_path / "lm" / "config.json").read_text())["dtype"] == "bfloat16"
        back = AutoModelForCausalLM.from_pretrained(tmp_path / "lm").eval()
        assert back.dtype == torch.bfloat16  # the same bf16 weights: the same numbers
        torch.testing.assert_close(back(ids, attention_mask=left).logits.float(), expected, atol=0, rtol=0)


# --- what lmkit cannot express, and what it must not misread --------------------------------------

def qwen2_config(**changes) -> dict:
    return Qwen2Config(hidden_size=32, intermediate_size=40, num_attention_heads=4, num_key_value_heads=2,
                       **{**SMALL, "num_hidden_layers": 3, **changes}).to_dict()


def write_config(folder: Path, raw: dict) -> Path:
    folder.mkdir(exist_ok=True)
    (folder / "config.json").write_text(json.dumps(raw))
    return folder


def test_qwen2_sliding_layers_are_read_as_transformers_reads_them(tmp_path):
    """use_sliding_window + max_window_layers (4.x) or layer_types (5.x, which wins) give the sliding layers."""
    from lmkit.hub import load_config

    def read(raw: dict):
        cfg = load_config(write_config(tmp_path, raw))[0]
        return cfg.sliding_window, cfg.sliding_layers

    assert read(qwen2_config(use_sliding_window=True, sliding_window=4, max_window_layers=1)) == (4, [1, 2])
    v4 = qwen2_config(use_sliding_window=True, sliding_window=4, max_window_layers=2)
    v4.pop("layer_types")  # 4.x: the layers come from max_window_layers
    assert read(v4) == (4, [2])
    v5 = qwen2_config(use_sliding_window=True, sliding_window=4, max_window_layers=0)
    v5["layer_types"] = ["sliding_attention", "full_attention", "sliding_attention"]
    assert read(v5) == (4, [0, 2])
    assert read(qwen2_config(use_sliding_window=True, sliding_window=4, max_window_layers=0)) == (4, None)  # every layer
    # windows switched off, or starting past the last layer: full attention everywhere
    for changes in (dict(use_sliding_window=False, sliding_window=4, max_window_layers=0),
                    dict(use_sliding_window=True, sliding_window=4, max_window_layers=3)):
        raw = qwen2_config(**changes)
        raw["sliding_window"] = 4  # as 4.x wrote it whatever use_sliding_window said
        assert read(raw) == (None, None)
    bad = qwen2_config()
    bad["layer_types"] = ["full_attention", "chunked_attention", "full_attention"]
    with pytest.raises(ConfigError, match="layer_types"):
        load_config(write_config(tmp_path, bad))


def test_partial_rotary_factor_is_refused(tmp_path):
    from lmkit.hub import load_config

    raw = qwen2_config()
    raw["rope_parameters"]["partial_rotary_factor"] = 0.5
    with pytest.raises(ConfigError, match="partial_rotary_factor"):
        load_config(write_config(tmp_path, raw))


def test_biases_a_format_cannot_hold_are_refused_on_save(tmp_path):
    from lmkit.config import get_preset
    from lmkit.models import build_model

    small = dict(vocab_size=64, d_model=32, n_layers=1, n_heads=4, n_kv_heads=2)
    qkv_only = build_model(get_preset("llama", attention_bias=True, attention_out_bias=False, **small))
    with pytest.raises(ConfigError, match="family='qwen2'"):
        qkv_only.save_pretrained(tmp_path / "llama")
    qkv_only.config.family = "qwen2"
    qkv_only.save_pretrained(tmp_path / "qwen2")  # the same model fits Qwen2
    assert type(AutoModelForCausalLM.from_pretrained(tmp_path / "qwen2")) is Qwen2ForCausalLM
    for family, bias in (("mistral", dict(attention_bias=True)), ("qwen2", dict(attention_bias=False)),
                         ("qwen2", dict(attention_bias=True, mlp_bias=True))):
        model = build_model(get_preset("llama", family=family, **bias, **small))
        with pytest.raises(ConfigError, match=f"the {family.capitalize() if family == 'mistral' else 'Qwen2'} format"):
            model.save_pretrained(tmp_path / family)


@pytest.mark.xdist_group("cli_generate")
def test_lmkit_generate_runs_on_a_qwen2_folder(tmp_path):
    """`lmkit generate --model DIR` on a transformers-written Qwen2 folder prints what transformers' greedy
    generate continues the prompt with."""
    tok = lmkit.train_tokenizer(["def main():\n    return 0\n", "the quick brown fox"] * 20, kind="bpe",
                                vocab_size=280)
    torch.manual_seed(0)
    hf = randomized(Qwen2ForCausalLM(Qwen2Config(
        vocab_size=tok.vocab_size, hidden_size=32, intermediate_size=40, num_hidden_layers=2, num_attention_heads=4,
        num_key_value_heads=2, max_position_embeddings=64, tie_word_embeddings=True)))
    hf.save_pretrained(tmp_path)
    tok.save(tmp_path / "tokenizer.json")
    prompt = "the quick"
    env = {**os.environ, "PYTHONPATH": str(Path(lmkit.__file__).parents[1]), "OMP_NUM_THREADS": "1"}
    res = subprocess.run([sys.executable, "-m", "lmkit", "generate", "--model", str(tmp_path), "--prompt", prompt,
                          "--max-new-tokens", "8"], capture_output=True, text=True, timeout=300, env=env)
    assert res.returncode == 0, res.stderr
    ids = torch.tensor([tok.encode(prompt, add_special_tokens=False)])
    out = hf.generate(ids, max_new_tokens=8, do_sample=False, pad_token_id=0)
    assert res.stdout.rstrip("\n") == prompt + tok.decode(out[0, ids.shape[1]:].tolist(), skip_special_tokens=True)
