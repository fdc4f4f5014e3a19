"""GPT-2 and LLaMA folders: lmkit against transformers on small random models of odd shapes.

Logits agree within 1e-4 (padded rows too, left and right padding), greedy generations are equal,
folders lmkit writes (single or sharded) load in transformers with the same logits, both the
transformers 4.x (`rope_theta`/`rope_scaling`) and 5.x (`rope_parameters`) config.json styles load (RoPE
scaling linear, dynamic, llama3 and yarn),
and damaged folders raise one clear LmkitError.
"""
import json
import os
import stat

import pytest
import torch

import lmkit
from lmkit.errors import CheckpointError, ConfigError, LmkitError
from helpers.hub_pairs import VOCAB, randomized, saved_pair
from tolerances import assert_close_in

transformers = pytest.importorskip("transformers")
transformers.logging.set_verbosity_error()
from transformers import AutoModelForCausalLM, GPT2Config, GPT2LMHeadModel, LlamaConfig, LlamaForCausalLM  # noqa: E402


CASES = {
    "gpt2-d36-h3-gelu_new-tied": lambda: GPT2LMHeadModel(GPT2Config(
        vocab_size=VOCAB, n_embd=36, n_layer=2, n_head=3, n_positions=48, activation_function="gelu_new",
        bos_token_id=0, eos_token_id=0)),
    "gpt2-d20-h5-gelu-untied-ninner": lambda: GPT2LMHeadModel(GPT2Config(
        vocab_size=VOCAB, n_embd=20, n_layer=3, n_head=5, n_inner=52, n_positions=48, activation_function="gelu",
        tie_word_embeddings=False, bos_token_id=0, eos_token_id=0, layer_norm_epsilon=1e-6)),
    "llama-gqa-6h-2kv-untied": lambda: LlamaForCausalLM(LlamaConfig(
        vocab_size=VOCAB, hidden_size=36, intermediate_size=70, num_hidden_layers=2, num_attention_heads=6,
        num_key_value_heads=2, max_position_embeddings=64, rope_theta=500.0, tie_word_embeddings=False,
        bos_token_id=1, eos_token_id=2, pad_token_id=0)),
    "llama-mqa-tied-linear-scaling": lambda: LlamaForCausalLM(LlamaConfig(
        vocab_size=VOCAB, hidden_size=32, intermediate_size=44, num_hidden_layers=2, num_attention_heads=4,
        num_key_value_heads=1, max_position_embeddings=64, tie_word_embeddings=True, rms_norm_eps=1e-5,
        rope_scaling={"rope_type": "linear", "factor": 2.0}, bos_token_id=1, eos_token_id=2)),
    "llama-headdim-bias-llama3": lambda: LlamaForCausalLM(LlamaConfig(
        vocab_size=VOCAB, hidden_size=24, intermediate_size=40, num_hidden_layers=2, num_attention_heads=3,
        num_key_value_heads=3, head_dim=10, attention_bias=True, mlp_bias=True, max_position_embeddings=64,
        rope_scaling={"rope_type": "llama3", "factor": 8.0, "low_freq_factor": 1.0, "high_freq_factor": 4.0,
                      "original_max_position_embeddings": 16}, bos_token_id=1, eos_token_id=2)),
    "llama-gqa-yarn-mscale": lambda: LlamaForCausalLM(LlamaConfig(  # YaRN scales cos/sin by its attention factor
        vocab_size=VOCAB, hidden_size=32, intermediate_size=40, num_hidden_layers=2, num_attention_heads=4,
        num_key_value_heads=2, max_position_embeddings=64, rope_theta=1000.0,
        rope_scaling={"rope_type": "yarn", "factor": 4.0, "original_max_position_embeddings": 16, "beta_fast": 16,
                      "mscale": 0.707, "mscale_all_dim": 1.0}, bos_token_id=1, eos_token_id=2)),
    "llama-mqa-5h-tanh-gelu": lambda: LlamaForCausalLM(LlamaConfig(  # GeGLU with the tanh approximation
        vocab_size=VOCAB, hidden_size=40, intermediate_size=36, num_hidden_layers=2, num_attention_heads=5,
        num_key_value_heads=1, hidden_act="gelu_pytorch_tanh", max_position_embeddings=64, bos_token_id=1,
        eos_token_id=2)),
    "gpt2-d28-h4-relu-unscaled": lambda: GPT2LMHeadModel(GPT2Config(  # scale_attn_weights=false: softmax(Q K^T)
        vocab_size=VOCAB, n_embd=28, n_layer=2, n_head=4, n_positions=48, activation_function="relu",
        scale_attn_weights=False, bos_token_id=0, eos_token_id=0)),
    "gpt2-inverse-layer-idx-upcast": lambda: GPT2LMHeadModel(GPT2Config(  # layer i's scores / sqrt(d_head) / (i + 1)
        vocab_size=VOCAB, n_embd=24, n_layer=3, n_head=2, n_positions=48, activation_function="gelu_python",
        scale_attn_by_inverse_layer_idx=True, reorder_and_upcast_attn=True, bos_token_id=0, eos_token_id=0)),
}


def hf_model(name: str):
    torch.manual_seed(0)
    return randomized(CASES[name]())


@pytest.fixture(scope="module", params=list(CASES))
def pair(request, tmp_path_factory):
    return saved_pair(hf_model(request.param), request.param, tmp_path_factory)


def batch():
    g = torch.Generator().manual_seed(1)
    ids = torch.randint(3, VOCAB, (3, 9), generator=g)
    left = torch.ones_like(ids)
    left[1, :4] = 0
    right = torch.ones_like(ids)
    right[2, -3:] = 0
    return ids, left, right


def check_logits(hf, ours) -> None:
    """Logits within 1e-4 of transformers' on every row, padded positions included: no padding, left, right, both."""
    ids, left, right = batch()
    with torch.no_grad():
        for mask in (None, left, right, left * right):
            torch.testing.assert_close(ours(ids, attention_mask=mask).logits, hf(ids, attention_mask=mask).logits,
                                       atol=1e-4, rtol=0)


def check_greedy(hf, ours) -> None:
    """Greedy ids equal to transformers' generate, without padding and with a left-padded row."""
    ids, left, _ = batch()
    for mask in (None, left):
        expected = hf.generate(ids, attention_mask=mask, max_new_tokens=10, do_sample=False, pad_token_id=0)
        got = ours.generate(ids, attention_mask=mask, max_new_tokens=10, pad_token_id=0)
        assert got.tolist() == expected.tolist()


def test_logits_match_transformers_with_and_without_padding(pair):
    hf, ours, _ = pair
    assert not ours.training and ours.dtype == torch.float32
    check_logits(hf, ours)


def test_greedy_generation_matches_transformers(pair):
    check_greedy(*pair[:2])


def check_saved_folder(hf, ours, tmp_path) -> None:
    """ours.save_pretrained loads in transformers as hf's class with hf's logits, and back in lmkit unchanged."""
    ours.save_pretrained(tmp_path)
    back = AutoModelForCausalLM.from_pretrained(tmp_path).eval()
    assert type(back) is type(hf)
    ids, left, _ = batch()
    with torch.no_grad():
        torch.testing.assert_close(back(ids, attention_mask=left).logits, hf(ids, attention_mask=left).logits,
                                   atol=1e-5, rtol=0)
    again = lmkit.load_model(tmp_path)
    assert again.config == ours.config
    for (k, a), b in zip(ours.state_dict().items(), again.state_dict().values()):
        assert torch.equal(a, b), k


def test_saved_folder_loads_in_transformers_with_the_same_logits(pair, tmp_path):
    hf, ours, _ = pair
    check_saved_folder(hf, ours, tmp_path)


def check_sharded_folder(hf, ours, tmp_path) -> None:
    """Saved in several shards with an index, ours loads in lmkit and in transformers with hf's logits (left padding)."""
    lmkit.hub.save_pretrained(ours, tmp_path, max_shard_bytes=20_000)
    assert not (tmp_path / "model.safetensors").exists()
    index = json.loads((tmp_path / "model.safetensors.index.json").read_text())
    assert len(set(index["weight_map"].values())) > 1
    ids, left, _ = batch()
    with torch.no_grad():
        expected = hf(ids, attention_mask=left).logits
        torch.testing.assert_close(lmkit.load_model(tmp_path)(ids, attention_mask=left).logits, expected,
                                   atol=1e-4, rtol=0)
        back = AutoModelForCausalLM.from_pretrained(tmp_path).eval()
        torch.testing.assert_close(back(ids, attention_mask=left).logits, expected, atol=1e-4, rtol=0)


def test_sharded_folder_round_trips(pair, tmp_path):
    hf, ours, _ = pair
    check_sharded_folder(hf, ours, tmp_path)


def rewrite_config(folder, edit):
    path = folder / "config.json"
    raw = json.loads(path.read_text())
    edit(raw)
    path.write_text(json.dumps(raw))


def as_v4(raw: dict) -> None:
    """transformers 4.x spelling: rope_theta and rope_scaling keys, no rope_parameters."""
    params = dict(raw.pop("rope_parameters"))
    raw["rope_theta"] = params.pop("rope_theta")
    raw["rope_scaling"] = params if params.get("rope_type", "default") != "default" else None
    raw["transformers_version"] = "4.44.0"


@pytest.mark.parametrize("name", [n for n in CASES if n.startswith("llama")])
def test_v4_and_v5_style_llama_configs_give_the_same_model(name, tmp_path):
    hf = hf_model(name)
    hf.save_pretrained(tmp_path)
    assert "rope_parameters" in json.loads((tmp_path / "config.json").read_text())  # 5.x style as written
    ids, left, _ = batch()
    with torch.no_grad():
        expected = hf(ids, attention_mask=left).logits
        v5 = lmkit.load_model(tmp_path)
        torch.testing.assert_close(v5(ids, attention_mask=left).logits, expected, atol=1e-4, rtol=0)
        rewrite_config(tmp_path, as_v4)
        v4 = lmkit.load_model(tmp_path)
        assert (v4.config.rope_theta, v4.config.rope_scaling) == (v5.config.rope_theta, v5.config.rope_scaling)
        torch.testing.assert_close(v4(ids, attention_mask=left).logits, expected, atol=1e-4, rtol=0)
        # lmkit writes both spellings, and transformers reads them back to the same numbers
        out = tmp_path / "saved"
        v4.save_pretrained(out)
        raw = json.loads((out / "config.json").read_text())
        assert raw["rope_theta"] == raw["rope_parameters"]["rope_theta"]
        back = AutoModelForCausalLM.from_pretrained(out).eval()
        torch.testing.assert_close(back(ids, attention_mask=left).logits, expected, atol=1e-4, rtol=0)


def test_dynamic_ntk_rope_past_the_context_matches_transformers(tmp_path):
    """Dynamic NTK RoPE grows its base once positions outrun max_position_embeddings (8 here), so prompts longer
    than that generate, left-padded too, with the frequencies transformers recomputes at every step."""
    torch.manual_seed(0)
    randomized(LlamaForCausalLM(LlamaConfig(
        vocab_size=VOCAB, hidden_size=32, intermediate_size=48, num_hidden_layers=2, num_attention_heads=4,
        num_key_value_heads=2, max_position_embeddings=8, rope_scaling={"rope_type": "dynamic", "factor": 2.0},
        bos_token_id=1, eos_token_id=2))).save_pretrained(tmp_path)
    ours = lmkit.load_model(tmp_path)
    ids, left, _ = batch()  # 9 tokens > 8 positions

    def fresh():  # transformers' dynamic RoPE keeps the longest length it has seen, so one model per call
        return AutoModelForCausalLM.from_pretrained(tmp_path).eval()

    for mask in (None, left):
        with torch.no_grad():
            torch.testing.assert_close(ours(ids, attention_mask=mask).logits, fresh()(ids, attention_mask=mask).logits,
                                       atol=1e-4, rtol=0)
        expected = fresh().generate(ids, attention_mask=mask, max_new_tokens=8, do_sample=False, pad_token_id=0)
        got = ours.generate(ids, attention_mask=mask, max_new_tokens=8, pad_token_id=0)
        assert got.tolist() == expected.tolist()


def test_gpt2_base_model_names_without_prefix_load(tmp_path):
    """A GPT2Model folder (no `transformer.` prefix, no lm_head) loads as a tied CausalLM."""
    hf = hf_model("gpt2-d36-h3-gelu_new-tied")
    hf.transformer.save_pretrained(tmp_path)
    ours = lmkit.load_model(tmp_path)
    ids, _, _ = batch()
    with torch.no_grad():
        torch.testing.assert_close(ours(ids).logits, hf(ids).logits, atol=1e-4, rtol=0)


@pytest.mark.bf16
def test_load_in_bfloat16(tmp_path):
    hf = hf_model("llama-gqa-6h-2kv-untied")
    hf.save_pretrained(tmp_path)
    ours = lmkit.load_model(tmp_path, dtype=torch.bfloat16)
    assert ours.dtype == torch.bfloat16
    ids, _, _ = batch()
    with torch.no_grad():
        assert_close_in(torch.bfloat16, ours(ids).logits, hf(ids).logits, steps=4)  # bf16 against float32


@pytest.mark.bf16
def test_dtype_auto_and_names_as_transformers_takes_them(tmp_path):
    """dtype="auto" reads config.json's dtype (5.x) or torch_dtype (4.x), as transformers' default does; names work."""
    hf = hf_model("gpt2-d36-h3-gelu_new-tied").to(torch.bfloat16)
    hf.save_pretrained(tmp_path)
    ids, left, _ = batch()
    with torch.no_grad():
        theirs = AutoModelForCausalLM.from_pretrained(tmp_path).eval()
        assert theirs.dtype == torch.bfloat16
        expected = theirs(ids, attention_mask=left).logits.float()
        assert lmkit.load_model(tmp_path).dtype == torch.float32  # lmkit's default stays float32
        for dtype in ("auto", "bfloat16", torch.bfloat16):
            ours = lmkit.load_model(tmp_path, dtype=dtype)
            assert ours.dtype == torch.bfloat16
            assert_close_in(torch.bfloat16, ours(ids, attention_mask=left).logits, expected, steps=4)
        def as_v4_float16(raw):
            del raw["dtype"]
            raw["torch_dtype"] = "float16"

        rewrite_config(tmp_path, as_v4_float16)
        assert lmkit.load_model(tmp_path, dtype="auto").dtype == torch.float16
        with pytest.raises(ConfigError, match="int8"):
            lmkit.load_model(tmp_path, dtype="int8")


# --- bad input -----------------------------------------------------------------------------------

@pytest.fixture
def good_folder(tmp_path):
    hf_model("gpt2-d36-h3-gelu_new-tied").save_pretrained(tmp_path)
    return tmp_path


def test_unsupported_family_says_which_are(tmp_path):
    (tmp_path / "config.json").write_text(json.dumps({"model_type": "mamba", "hidden_size": 8}))
    with pytest.raises(ConfigError, match="mamba.*supported: .*gpt2.*llama"):
        lmkit.load_model(tmp_path)


def test_malformed_config_json(good_folder):
    (good_folder / "config.json").write_text('{"model_type": "gpt2", "n_embd": ')
    with pytest.raises(CheckpointError, match="not valid JSON"):
        lmkit.load_model(good_folder)
    (good_folder / "config.json").write_text('["gpt2"]')
    with pytest.raises(CheckpointError, match="JSON object"):
        lmkit.load_model(good_folder)


def test_a_config_that_does_not_belong_to_the_weights_is_refused_before_allocating(good_folder):
    """A bare {"model_type": "llama"} means transformers' 7B defaults: refused by counting, not by running out of memory."""
    (good_folder / "config.json").write_text(json.dumps({"model_type": "llama"}))
    with pytest.raises(CheckpointError, match="6,738,415,616 parameters but the weights hold .*does not belong"):
        lmkit.load_model(good_folder)


def test_saved_files_have_the_usual_mode(tmp_path):
    """Written atomically through temporary files, yet with the mode the umask gives (safetensors writes 0600)."""
    old = os.umask(0o022)
    try:
        hf_model("llama-gqa-6h-2kv-untied").save_pretrained(tmp_path / "hf")
        lmkit.load_model(tmp_path / "hf").save_pretrained(tmp_path / "ours")
    finally:
        os.umask(old)
    for name in ("model.safetensors", "config.json"):
        assert stat.S_IMODE((tmp_path / "ours" / name).stat().st_mode) == 0o644, name


def test_malformed_field_in_config(good_folder):
    rewrite_config(good_folder, lambda raw: raw.update(n_layer="two"))
    with pytest.raises(LmkitError, match="n_layer|malformed"):
        lmkit.load_model(good_folder)


def test_truncated_safetensors(good_folder):
    path = good_folder / "model.safetensors"
    path.write_bytes(path.read_bytes()[: path.stat().st_size // 2])
    with pytest.raises(CheckpointError, match="damaged or truncated"):
        lmkit.load_model(good_folder)


def test_wrong_tensor_shapes(good_folder):
    rewrite_config(good_folder, lambda raw: raw.update(n_inner=100))
    with pytest.raises(CheckpointError, match="disagree"):
        lmkit.load_model(good_folder)


def test_missing_weights_and_missing_tensor(good_folder, tmp_path):
    from safetensors.torch import load_file, save_file

    tensors = load_file(good_folder / "model.safetensors")
    del tensors["transformer.h.1.mlp.c_fc.weight"]
    save_file(tensors, good_folder / "model.safetensors")
    with pytest.raises(CheckpointError, match="c_fc.weight"):
        lmkit.load_model(good_folder)
    (good_folder / "model.safetensors").unlink()
    with pytest.raises(CheckpointError, match="model.safetensors"):
        lmkit.load_model(good_folder)
    with pytest.raises(CheckpointError, match="not a folder"):
        lmkit.load_model(tmp_path / "nowhere")


def test_layer_scaled_attention_stays_in_the_gpt2_format(tmp_path):
    ours = lmkit.load_model(_saved(hf_model("gpt2-inverse-layer-idx-upcast"), tmp_path / "gpt2"))
    assert ours.config.attention_scale_by_layer
    with pytest.raises(ConfigError, match="attention_scale_by_layer"):
        lmkit.hub.save_pretrained(ours.__class__(ours.config.replace(family="llama")), tmp_path / "llama")


def _saved(model, folder):
    model.save_pretrained(folder)
    return folder


@pytest.mark.parametrize("family", ["llama", "mistral", "qwen2"])
def test_base_model_folders_load_with_a_tied_head_or_are_refused(family, tmp_path):
    """A LlamaModel-style folder (no "model." prefix, no lm_head) loads when config.json ties the head to the
    embeddings, as the ...ForCausalLM class would build it; untied, it has no head to load and says so."""
    name = {"llama": "Llama", "mistral": "Mistral", "qwen2": "Qwen2"}[family]
    config_class, lm_class, base_class = (getattr(transformers, name + kind) for kind in ("Config", "ForCausalLM", "Model"))
    for tied in (True, False):
        torch.manual_seed(0)
        cfg = config_class(vocab_size=VOCAB, hidden_size=24, intermediate_size=40, num_hidden_layers=2,
                           num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=64,
                           tie_word_embeddings=tied)
        lm = randomized(lm_class(cfg))
        base = base_class(cfg)
        base.load_state_dict(lm.model.state_dict())
        folder = _saved(base, tmp_path / str(tied))
        if not tied:
            with pytest.raises(CheckpointError, match="base model saved without its language-model head"):
                lmkit.load_model(folder)
            continue
        ids, left, _ = batch()
        with torch.no_grad():
            torch.testing.assert_close(lmkit.load_model(folder)(ids, attention_mask=left).logits,
                                       lm(ids, attention_mask=left).logits, atol=1e-4, rtol=0)


@pytest.mark.parametrize("alias,same", [("gelu_accurate", "gelu_new"), ("gelu_python", "gelu"),
                                        ("gelu_python_tanh", "gelu_new")])
def test_activation_spellings_of_the_same_function(alias, same):
    from lmkit.hub import gpt2, llama

    assert gpt2.config_from_hf({"activation_function": alias}) == gpt2.config_from_hf({"activation_function": same})
    assert llama.config_from_hf({"hidden_act": alias}) == llama.config_from_hf({"hidden_act": same})
