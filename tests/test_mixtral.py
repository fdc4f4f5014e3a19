"""Mixtral folders: lmkit.load_model gives the logits (and load-balancing loss) transformers gives."""
import json

import pytest
import torch
from safetensors.torch import save_file

import lmkit
from lmkit.errors import ConfigError

transformers = pytest.importorskip("transformers")



def hf_mixtral(layers=2, experts=4, k=2, seed=0):
    torch.manual_seed(seed)
    config = transformers.MixtralConfig(
        vocab_size=97, hidden_size=48, intermediate_size=36, num_hidden_layers=layers, num_attention_heads=6,
        num_key_value_heads=2, num_local_experts=experts, num_experts_per_tok=k, max_position_embeddings=64,
        rope_theta=10000.0, tie_word_embeddings=False)
    model = transformers.MixtralForCausalLM(config).eval()
    with torch.no_grad():  # random (not zero-initialised) norms and router, to exercise every tensor
        for name, p in model.named_parameters():
            if "norm" in name:
                p.uniform_(0.5, 1.5)
            if "gate.weight" in name:
                p.normal_(0, 0.5)
    return model


def test_logits_equal_transformers_v5_folder(tmp_path):
    ref = hf_mixtral()
    ref.save_pretrained(tmp_path)
    model = lmkit.load_model(tmp_path)
    ids = torch.randint(0, 97, (3, 13))
    mask = torch.ones_like(ids)
    mask[1, :4] = 0  # left padding
    mask[2, -3:] = 0  # right padding
    with torch.no_grad():
        want = ref(ids, attention_mask=mask).logits
        got = model(ids, attention_mask=mask).logits
    keep = mask.bool()
    torch.testing.assert_close(got[keep], want[keep], rtol=1e-4, atol=1e-4)


def test_fused_and_per_expert_layouts_both_load(tmp_path):
    ref = hf_mixtral(seed=1)
    ref.save_pretrained(tmp_path / "saved")
    # the in-memory (fused, transformers 5) layout, written as a folder
    fused = tmp_path / "fused"
    fused.mkdir()
    save_file({k: v.contiguous() for k, v in ref.state_dict().items()}, str(fused / "model.safetensors"))
    (fused / "config.json").write_text((tmp_path / "saved" / "config.json").read_text())
    ids = torch.randint(0, 97, (2, 9))
    with torch.no_grad():
        want = ref(ids).logits
        for folder in (tmp_path / "saved", fused):
            torch.testing.assert_close(lmkit.load_model(folder)(ids).logits, want, rtol=1e-4, atol=1e-4)


def test_v4_style_config_and_roundtrip(tmp_path):
    ref = hf_mixtral(seed=2)
    ref.save_pretrained(tmp_path / "a")
    raw = json.loads((tmp_path / "a" / "config.json").read_text())
    params = raw.pop("rope_parameters")
    raw["rope_theta"] = params["rope_theta"]
    (tmp_path / "a" / "config.json").write_text(json.dumps(raw))
    model = lmkit.load_model(tmp_path / "a")
    model.save_pretrained(tmp_path / "b")
    back = transformers.MixtralForCausalLM.from_pretrained(tmp_path / "b").eval()
    ids = torch.randint(0, 97, (2, 10))
    with torch.no_grad():
        torch.testing.assert_close(back(ids).logits, ref(ids).logits, rtol=1e-5, atol=1e-5)
        torch.testing.assert_close(model(ids).logits, ref(ids).logits, rtol=1e-4, atol=1e-4)


def test_aux_loss_matches_transformers_for_one_layer(tmp_path):
    ref = hf_mixtral(layers=1, experts=5, k=2, seed=3)
    ref.save_pretrained(tmp_path)
    model = lmkit.load_model(tmp_path)
    ids = torch.randint(0, 97, (2, 11))
    with torch.no_grad():
        want = ref(ids, output_router_logits=True).aux_loss
        got = model(ids).aux_loss
    coef = model.config.router_aux_loss_coef
    torch.testing.assert_close(got / coef, want, rtol=1e-5, atol=1e-6)


def test_greedy_generation_matches(tmp_path):
    ref = hf_mixtral(seed=4)
    ref.save_pretrained(tmp_path)
    model = lmkit.load_model(tmp_path)
    ids = torch.randint(0, 97, (1, 5))
    want = ref.generate(ids, max_new_tokens=8, do_sample=False, pad_token_id=0)
    got = model.generate(ids, max_new_tokens=8, do_sample=False, pad_token_id=0)
    assert got.tolist() == want.tolist()


def test_sliding_window_is_refused(tmp_path):
    ref = hf_mixtral(layers=1)
    ref.save_pretrained(tmp_path)
    raw = json.loads((tmp_path / "config.json").read_text())
    raw["sliding_window"] = 8
    (tmp_path / "config.json").write_text(json.dumps(raw))
    with pytest.raises(ConfigError, match="sliding_window"):
        lmkit.load_model(tmp_path)
