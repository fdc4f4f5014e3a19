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


SHAPES = [  # experts, k, heads, kv heads, tied, rope parameters, hidden_act
    (3, 1, 6, 2, False, None, "silu"),
    (5, 3, 4, 1, True, {"rope_type": "linear", "factor": 2.0}, "silu"),
    (8, 2, 6, 3, False, {"rope_type": "yarn", "factor": 4.0, "original_max_position_embeddings": 16}, "silu"),
    (5, 2, 6, 6, False, {"rope_type": "dynamic", "factor": 2.0}, "gelu"),
]


@pytest.mark.parametrize("experts,k,heads,kv,tied,rope,act", SHAPES)
def test_loss_aux_loss_and_router_logits_match_transformers(tmp_path, experts, k, heads, kv, tied, rope, act):
    torch.manual_seed(7)
    config = transformers.MixtralConfig(
        vocab_size=97, hidden_size=48, intermediate_size=20, num_hidden_layers=3, num_attention_heads=heads,
        num_key_value_heads=kv, head_dim=8, num_local_experts=experts, num_experts_per_tok=k, hidden_act=act,
        max_position_embeddings=64, tie_word_embeddings=tied, router_aux_loss_coef=0.37,
        rope_parameters={"rope_type": "default", "rope_theta": 10000.0, **(rope or {})})
    ref = transformers.MixtralForCausalLM(config).eval()
    with torch.no_grad():
        for name, p in ref.named_parameters():
            if "gate.weight" in name:
                p.normal_(0, 0.5)
    ref.save_pretrained(tmp_path / "hf")
    model = lmkit.load_model(tmp_path / "hf")
    ids = torch.randint(1, 97, (3, 11))
    mask = torch.ones_like(ids)
    mask[1, :3] = 0
    mask[2, :6] = 0                                              # left padding
    labels = ids.masked_fill(mask == 0, -100)
    for router in (False, True):
        want = ref(ids, attention_mask=mask, labels=labels, output_router_logits=router)
        got = model(ids, attention_mask=mask, labels=labels, output_router_logits=router)
        torch.testing.assert_close(got.loss, want.loss, rtol=1e-5, atol=1e-5)
        torch.testing.assert_close(got.logits[mask.bool()], want.logits[mask.bool()], rtol=1e-4, atol=1e-4)
    torch.testing.assert_close(got.aux_loss, want.aux_loss, rtol=1e-5, atol=1e-6)    # unscaled, padding left out
    for mine, theirs in zip(got.router_logits, want.router_logits, strict=True):
        torch.testing.assert_close(mine.view(3, 11, -1)[mask.bool()], theirs.view(3, 11, -1)[mask.bool()],
                                   rtol=1e-4, atol=1e-5)
    out = ref.generate(ids, attention_mask=mask, max_new_tokens=6, do_sample=False, pad_token_id=0)
    assert model.generate(ids, attention_mask=mask, max_new_tokens=6, do_sample=False, pad_token_id=0).tolist() == \
        out.tolist()
    model.save_pretrained(tmp_path / "lm")                       # the folder lmkit writes loads in transformers
    back = transformers.MixtralForCausalLM.from_pretrained(tmp_path / "lm").eval()
    torch.testing.assert_close(back(ids, attention_mask=mask).logits, want.logits, rtol=1e-5, atol=1e-5)


MATRIX = [  # layers, experts, k, hidden (odd widths: head_dim 8 is set apart from hidden / heads), heads
    (1, 4, 1, 35, 5), (1, 8, 2, 48, 6), (2, 4, 2, 33, 3), (2, 8, 1, 35, 5), (3, 4, 1, 48, 6), (3, 8, 2, 35, 5),
]


@pytest.mark.parametrize("layers,experts,k,hidden,heads", MATRIX)
def test_loss_aux_loss_and_gradients_match_transformers_padded_either_side(tmp_path, layers, experts, k, hidden, heads):
    """loss = CE + coef * aux_loss with aux_loss pooled over every layer's unpadded rows, as MixtralForCausalLM
    computes it with output_router_logits=True; the gradients through the router agree too."""
    torch.manual_seed(layers * 100 + experts * 10 + k)
    config = transformers.MixtralConfig(
        vocab_size=97, hidden_size=hidden, intermediate_size=19, num_hidden_layers=layers, num_attention_heads=heads,
        num_key_value_heads=1, head_dim=8, num_local_experts=experts, num_experts_per_tok=k,
        max_position_embeddings=64, router_aux_loss_coef=0.29, tie_word_embeddings=False)
    ref = transformers.MixtralForCausalLM(config).eval()
    with torch.no_grad():
        for name, p in ref.named_parameters():
            if "gate.weight" in name:
                p.normal_(0, 0.7)
    ref.save_pretrained(tmp_path)
    ref.config._experts_implementation = "eager"   # grouped_mm needs 16-byte aligned strides, odd widths have none
    model = lmkit.load_model(tmp_path)
    ids = torch.randint(1, 97, (3, 10))
    for side in ("left", "right", None):
        mask = torch.ones_like(ids)
        if side == "left":
            mask[1, :3], mask[2, :7] = 0, 0
        elif side == "right":
            mask[1, -3:], mask[2, -7:] = 0, 0
        labels = ids.masked_fill(mask == 0, -100)
        m = mask if side else None
        ref.zero_grad()
        model.zero_grad()
        want = ref(ids, attention_mask=m, labels=labels, output_router_logits=True)
        got = model(ids, attention_mask=m, labels=labels, output_router_logits=True)
        torch.testing.assert_close(got.loss, want.loss, rtol=1e-5, atol=1e-5)
        torch.testing.assert_close(got.aux_loss, want.aux_loss, rtol=1e-5, atol=1e-5)
        keep = mask.bool().reshape(-1)
        assert len(got.router_logits) == len(want.router_logits) == layers
        for mine, theirs in zip(got.router_logits, want.router_logits):
            torch.testing.assert_close(mine[keep], theirs[keep], rtol=1e-4, atol=1e-5)
        want.loss.backward()
        got.loss.backward()
        for i in range(layers):
            torch.testing.assert_close(model.decoder.layers[i].mlp.sublayer.gate.weight.grad,
                                       ref.model.layers[i].mlp.gate.weight.grad, rtol=1e-4, atol=1e-6)


def test_output_router_logits_and_jitter_come_from_config_json(tmp_path):
    torch.manual_seed(8)
    config = transformers.MixtralConfig(
        vocab_size=97, hidden_size=32, intermediate_size=20, num_hidden_layers=2, num_attention_heads=4,
        num_key_value_heads=2, num_local_experts=4, num_experts_per_tok=2, max_position_embeddings=64,
        output_router_logits=True, router_jitter_noise=0.3, router_aux_loss_coef=0.5)
    ref = transformers.MixtralForCausalLM(config)
    ref.save_pretrained(tmp_path / "hf")
    model = lmkit.load_model(tmp_path / "hf")
    ids = torch.randint(0, 97, (2, 9))
    for train in (False, True):                                  # jitter: x * U(1 - j, 1 + j) in training only
        ref.train(train)
        model.train(train)
        torch.manual_seed(9)
        want = ref(ids, labels=ids)
        torch.manual_seed(9)
        got = model(ids, labels=ids)
        torch.testing.assert_close(got.loss, want.loss, rtol=1e-5, atol=1e-5)
        torch.testing.assert_close(got.aux_loss, want.aux_loss, rtol=1e-5, atol=1e-6)
    model.save_pretrained(tmp_path / "lm")
    saved = json.loads((tmp_path / "lm" / "config.json").read_text())
    assert saved["output_router_logits"] is True and saved["router_jitter_noise"] == 0.3
    assert model.config.router_aux_loss_coef == saved["router_aux_loss_coef"] == 0.5
    back = transformers.MixtralForCausalLM.from_pretrained(tmp_path / "lm")
    assert (back.config.router_aux_loss_coef, back.config.output_router_logits) == (0.5, True)


def test_greedy_generation_matches(tmp_path):
    ref = hf_mixtral(seed=4)
    ref.save_pretrained(tmp_path)
    model = lmkit.load_model(tmp_path)
    ids = torch.randint(0, 97, (1, 5))
    want = ref.generate(ids, max_new_tokens=8, do_sample=False, pad_token_id=0)
    got = model.generate(ids, max_new_tokens=8, do_sample=False, pad_token_id=0)
    assert got.tolist() == want.tolist()


@pytest.mark.parametrize("window", [1, 4, 7])
def test_sliding_window_matches_transformers(tmp_path, window):
    torch.manual_seed(10)
    config = transformers.MixtralConfig(
        vocab_size=97, hidden_size=32, intermediate_size=20, num_hidden_layers=2, num_attention_heads=4,
        num_key_value_heads=2, num_local_experts=3, num_experts_per_tok=2, max_position_embeddings=64,
        sliding_window=window)
    ref = transformers.MixtralForCausalLM(config).eval()
    ref.save_pretrained(tmp_path / "hf")
    model = lmkit.load_model(tmp_path / "hf")
    assert model.config.sliding_window == window
    ids = torch.randint(1, 97, (3, 12))
    mask = torch.ones_like(ids)
    mask[1, :5] = 0                                              # left padding
    keep = mask.bool()
    with torch.no_grad():
        want = ref(ids, attention_mask=mask).logits
        torch.testing.assert_close(model(ids, attention_mask=mask).logits[keep], want[keep], rtol=1e-4, atol=1e-4)
        full = model(ids[:1]).logits                                 # no padding: the windowed causal mask alone
        torch.testing.assert_close(full, ref(ids[:1]).logits, rtol=1e-4, atol=1e-4)
    for rows, m in ((ids[:1], None), (ids, mask)):               # decoding past the window, through the cache
        # transformers without its cache: with a window of 1 its sliding cache keeps every key (a [-0:] slice)
        out = ref.generate(rows, attention_mask=m, max_new_tokens=10, do_sample=False, pad_token_id=0, use_cache=False)
        assert model.generate(rows, attention_mask=m, max_new_tokens=10, do_sample=False, pad_token_id=0).tolist() \
            == out.tolist()
    model.save_pretrained(tmp_path / "lm")
    assert json.loads((tmp_path / "lm" / "config.json").read_text())["sliding_window"] == window
    back = transformers.MixtralForCausalLM.from_pretrained(tmp_path / "lm").eval()
    with torch.no_grad():
        torch.testing.assert_close(back(ids, attention_mask=mask).logits, want, rtol=1e-5, atol=1e-5)


def test_a_window_cannot_be_saved_where_the_format_has_none(tmp_path):
    from lmkit.config import get_preset
    from lmkit.models import build_model

    model = build_model(get_preset("llama", vocab_size=64, d_model=32, n_layers=1, n_heads=4, n_kv_heads=2, sliding_window=8))
    with pytest.raises(ConfigError, match="no sliding window"):
        model.save_pretrained(tmp_path)


@pytest.mark.parametrize("family", ["gpt2", "llama", "mistral", "bert", "t5"])
def test_experts_cannot_be_saved_where_the_format_has_none(tmp_path, family):
    from lmkit.config import get_preset
    from lmkit.models import build_model

    preset = {"mistral": "llama"}.get(family, family)
    config = get_preset(preset, vocab_size=64, d_model=32, n_layers=1, n_heads=4, n_kv_heads=4, d_ff=24, n_experts=3,
                        family=family)
    with pytest.raises(ConfigError, match="mixture of experts"):
        build_model(config).save_pretrained(tmp_path)
    assert not (tmp_path / "config.json").exists()


def test_dense_model_with_a_window_decodes_like_its_full_forward():
    from lmkit.config import get_preset
    from lmkit.models import build_model

    torch.manual_seed(11)
    model = build_model(get_preset("llama", vocab_size=64, d_model=32, n_layers=2, n_heads=4, n_kv_heads=2,
                                   sliding_window=3, init_std=0.3)).eval()
    ids = torch.randint(0, 64, (1, 6))
    got = model.generate(ids, max_new_tokens=8, do_sample=False)     # cached steps through DecodePlan
    seq = ids
    with torch.no_grad():
        for _ in range(8):
            seq = torch.cat([seq, model(seq).logits[:, -1:].argmax(-1)], dim=1)
    assert got.tolist() == seq.tolist()


@pytest.mark.bf16
def test_bfloat16_router_matches_transformers(tmp_path):
    """Router logits in bf16, softmax in float32, top-k, renormalised weights in float32, the expert outputs
    scaled in float32 and cast back: the same numbers as transformers' eager experts in bf16."""
    ref = hf_mixtral(experts=5, k=2, seed=12)
    ref.save_pretrained(tmp_path)
    ref.config._experts_implementation = "eager"   # its default grouped_mm needs 16-byte aligned strides
    ref = ref.to(torch.bfloat16)
    model = lmkit.load_model(tmp_path, dtype=torch.bfloat16)
    ids = torch.randint(0, 97, (2, 11))
    mask = torch.ones_like(ids)
    mask[1, :4] = 0
    with torch.no_grad():
        want = ref(ids, attention_mask=mask, output_router_logits=True)
        got = model(ids, attention_mask=mask)
    torch.testing.assert_close(got.logits[mask.bool()], want.logits[mask.bool()], rtol=0, atol=0)
    torch.testing.assert_close(got.aux_loss, want.aux_loss, rtol=1e-6, atol=1e-6)
