"""Differential fuzz of loading and saving GPT-2, LLaMA, Mistral, Qwen2 and Mixtral folders against transformers.

Hypothesis draws small odd configs (GQA/MQA, head_dim apart from hidden / heads, activations, eps, biases, RoPE
scaling in the 5.x and 4.x spellings, sliding windows and layer types, experts, GPT-2's attention switches) and
padded inputs; each model goes transformers -> folder -> lmkit with the same logits and loss, a transformers
4.x style config.json of the same weights loads alike, lmkit's save keeps every setting and loads back in
transformers without missing or unexpected tensors (lmkit's own decoders built from presets too), and
half-precision folders load with dtype="auto".
Heads lmkit has no decoder class for (sequence and token classification) are refused, never dropped.
HUB_FUZZ_EXAMPLES raises the number of examples.
"""
from __future__ import annotations

import json

import pytest
import torch
from hypothesis import given, note, strategies as st

import lmkit
from lmkit.errors import CheckpointError, ConfigError
from lmkit.hub.convert import HF_ACTIVATIONS, HF_GATED_ACTIVATIONS
from test_fuzz_hub_encoders import FUZZ, MASK_DTYPES, same_config, v4_style

transformers = pytest.importorskip("transformers")
transformers.logging.set_verbosity_error()

CLASS = {"gpt2": "GPT2", "llama": "Llama", "mistral": "Mistral", "qwen2": "Qwen2", "mixtral": "Mixtral"}
LM = {"gpt2": "LMHeadModel"}  # the language-model class suffix, ForCausalLM elsewhere
EAGER = {"mixtral": {"experts_implementation": "eager"}}  # transformers' grouped_mm fails on tiny experts
REFUSED = ("ForSequenceClassification", "ForTokenClassification")  # decoder heads lmkit has no model for


def lm_suffix(family):
    return LM.get(family, "ForCausalLM")


@st.composite
def rope_parameters(draw, max_pos):
    """transformers 5's rope_parameters of a random RoPE scaling."""
    kind = draw(st.sampled_from(["default", "linear", "dynamic", "llama3", "yarn"]))
    out = {"rope_type": kind, "rope_theta": draw(st.sampled_from([10000.0, 500.0, 1e6]))}
    if kind != "default":
        out["factor"] = draw(st.sampled_from([1.5, 2.0, 4.0, 8.0]))
    if kind == "llama3":
        out.update(low_freq_factor=draw(st.sampled_from([1.0, 2.0])), high_freq_factor=draw(st.sampled_from([3.0, 4.0])),
                   original_max_position_embeddings=draw(st.integers(4, max_pos)))
    if kind == "yarn":
        if draw(st.booleans()):
            out["original_max_position_embeddings"] = draw(st.integers(4, max_pos))
        if draw(st.booleans()):
            out.update(beta_fast=draw(st.sampled_from([8.0, 32.0])), beta_slow=draw(st.sampled_from([1.0, 2.0])))
        extra = draw(st.sampled_from(["none", "attention_factor", "mscale", "truncate"]))
        if extra == "attention_factor":
            out["attention_factor"] = draw(st.sampled_from([0.8, 1.3]))
        elif extra == "mscale":
            out.update(mscale=draw(st.sampled_from([0.707, 1.0])), mscale_all_dim=draw(st.sampled_from([1.0, 0.5])))
        elif extra == "truncate":
            out["truncate"] = False
    return out


@st.composite
def decoder_configs(draw, family=None, head=None):
    """(family, transformers class suffix, transformers config) of a small random decoder."""
    family = family or draw(st.sampled_from(sorted(CLASS)))
    head = head or draw(st.sampled_from([lm_suffix(family)] * 4 + ["Model", *REFUSED]))
    heads = draw(st.integers(1, 4))
    common = dict(vocab_size=draw(st.integers(20, 60)), tie_word_embeddings=draw(st.booleans()), bos_token_id=1,
                  eos_token_id=2, pad_token_id=draw(st.sampled_from([None, 0])))
    if head in REFUSED:
        common["num_labels"] = draw(st.integers(1, 3))
    if family == "gpt2":
        return family, head, transformers.GPT2Config(
            n_embd=heads * draw(st.integers(1, 7)), n_layer=draw(st.integers(1, 3)), n_head=heads,
            n_inner=draw(st.one_of(st.none(), st.integers(1, 30))), n_positions=draw(st.integers(12, 30)),
            activation_function=draw(st.sampled_from(sorted(HF_ACTIVATIONS))),
            layer_norm_epsilon=draw(st.sampled_from([1e-5, 1e-3, 0.1])), scale_attn_weights=draw(st.booleans()),
            scale_attn_by_inverse_layer_idx=draw(st.booleans()), reorder_and_upcast_attn=draw(st.booleans()),
            resid_pdrop=0.0, embd_pdrop=0.0, attn_pdrop=0.0, **common)
    kv = draw(st.sampled_from([d for d in range(1, heads + 1) if heads % d == 0]))
    rope = draw(rope_parameters(max_pos := draw(st.integers(6, 24))))
    # RoPE needs an even rotary size; transformers' dynamic NTK divides by head_dim - 2
    head_dim = 2 * draw(st.integers(2 if rope["rope_type"] == "dynamic" else 1, 5))
    hidden = heads * draw(st.integers(1, 7))  # odd sizes, head_dim apart (transformers wants heads | hidden)
    layers = draw(st.integers(1, 3))
    kw = dict(hidden_size=hidden, num_hidden_layers=layers, num_attention_heads=heads, num_key_value_heads=kv,
              intermediate_size=draw(st.integers(1, 30)), hidden_act=draw(st.sampled_from(sorted(HF_GATED_ACTIVATIONS))),
              max_position_embeddings=max_pos, rms_norm_eps=draw(st.sampled_from([1e-6, 1e-5, 1e-3, 0.1])),
              rope_parameters=rope, attention_dropout=0.0, **common)
    # an odd (or, dynamic, a 2-wide) hidden / heads needs one; transformers' Mixtral RoPE fails without one
    implied = hidden // heads
    if draw(st.booleans()) or implied % 2 or implied == 2 and rope["rope_type"] == "dynamic" or family == "mixtral":
        kw["head_dim"] = head_dim
    if family == "llama":
        kw.update(attention_bias=draw(st.booleans()), mlp_bias=draw(st.booleans()))
    if family in ("mistral", "mixtral"):
        kw["sliding_window"] = draw(st.sampled_from([None, 2, 3, 5, 4096]))
    if family == "qwen2":
        kw.update(use_sliding_window=draw(st.booleans()), sliding_window=draw(st.sampled_from([2, 3, 5])))
        if not kw["use_sliding_window"] or draw(st.booleans()):  # (sliding layer types without a window crash it)
            kw["max_window_layers"] = draw(st.integers(0, layers))
        else:
            kw["layer_types"] = draw(st.lists(st.sampled_from(["full_attention", "sliding_attention"]),
                                              min_size=layers, max_size=layers))
    if family == "mixtral":
        experts = draw(st.integers(1, 4))
        kw.update(num_local_experts=experts, num_experts_per_tok=draw(st.integers(1, experts)),
                  router_aux_loss_coef=draw(st.sampled_from([0.001, 0.02, 0.5])),
                  output_router_logits=draw(st.booleans()), experts_implementation="eager")  # grouped_mm wants
        # 16-byte strides
    return family, head, getattr(transformers, CLASS[family] + "Config")(**kw)


def hf_decoder(family, head, cfg, seed):
    torch.manual_seed(seed)
    model = getattr(transformers, CLASS[family] + head)(cfg)
    with torch.no_grad():
        for name, p in model.named_parameters():
            if p.dim() > 1:
                p.normal_(0, 0.3)
            else:  # nonzero biases and norms off 1, so every tensor's mapping shows
                p.normal_(1.0 if "norm" in name or "ln_" in name else 0.0, 0.3)
    return model.eval()


@st.composite
def decoder_inputs(draw, cfg, labels=True):
    """Keyword arguments of one random batch, padded right or left, with labels sometimes."""
    batch, length = draw(st.integers(1, 3)), draw(st.integers(1, 12))
    g = torch.Generator().manual_seed(draw(st.integers(0, 2**16)))
    ids = torch.randint(0, cfg.vocab_size, (batch, length), generator=g)
    mask = torch.ones_like(ids)
    for row in range(batch):
        side, n = draw(st.sampled_from(["none", "right", "left"])), draw(st.integers(0, length - 1))
        if side == "right" and n:
            mask[row, -n:] = 0
        elif side == "left" and n:
            mask[row, :n] = 0
    ids[mask == 0] = cfg.pad_token_id or 0
    out = dict(input_ids=ids)
    if draw(st.booleans()):
        out["attention_mask"] = mask.to(draw(st.sampled_from(MASK_DTYPES)))
    if labels and draw(st.booleans()):
        out["labels"] = torch.where(mask.bool(), ids, -100)
    return out


def compare(ref, got, atol=1e-4, name="logits"):
    """got's logits (or last hidden states) and loss within atol of transformers' ref."""
    expected, value = getattr(ref, name if name == "logits" else "last_hidden_state"), getattr(got, name)
    assert value.shape == expected.shape, (value.shape, expected.shape)
    torch.testing.assert_close(value.float(), expected.float(), atol=atol, rtol=1e-4, msg=lambda m: f"{name}: {m}")
    if getattr(ref, "loss", None) is not None:
        torch.testing.assert_close(got.loss.float(), ref.loss.float(), atol=atol, rtol=1e-5, equal_nan=True,
                                   msg=lambda m: f"loss: {m}")


def v4_rope(folder, old_type=False):
    """transformers 4.x's config.json of the same model: torch_dtype, RoPE as rope_theta + rope_scaling (old_type:
    its first spelling {"type": ...}), and Qwen2's layers said by max_window_layers alone where it can say them."""
    v4_style(folder)
    path = folder / "config.json"
    raw = json.loads(path.read_text())
    if "rope_parameters" in raw:
        params = dict(raw.pop("rope_parameters"))
        raw["rope_theta"] = params.pop("rope_theta")
        if old_type:
            params["type"] = params.pop("rope_type")
        raw["rope_scaling"] = None if params.get("type", params.get("rope_type")) == "default" else params
    if raw.get("layer_types") and raw.get("use_sliding_window"):
        first = raw.get("max_window_layers", 28)
        if raw["layer_types"] == ["sliding_attention" if i >= first else "full_attention"
                                  for i in range(raw["num_hidden_layers"])]:
            raw.pop("layer_types")
    path.write_text(json.dumps(raw))


@FUZZ
@given(st.data())
def test_decoder_folders_load_and_save_as_transformers(tmp_path_factory, data):
    family, head, cfg = data.draw(decoder_configs())
    note(f"{family}{head} {cfg.to_diff_dict()}")
    hf = hf_decoder(family, head, cfg, data.draw(st.integers(0, 100)))
    folder = tmp_path_factory.mktemp("hf")
    hf.save_pretrained(folder)
    if head in REFUSED:
        with pytest.raises(ConfigError, match=head):
            lmkit.load_model(folder)
        return
    if head == "Model" and not cfg.tie_word_embeddings:  # a base model: its head is the token table, or none
        with pytest.raises(CheckpointError, match="no lm_head.weight"):
            lmkit.load_model(folder)
        return
    ours = lmkit.load_model(folder)
    assert next(ours.parameters()).dtype == torch.float32 and not ours.training
    inputs = data.draw(decoder_inputs(cfg, labels=head != "Model"))
    name = "logits" if head != "Model" else "last_hidden_state"
    with torch.no_grad():
        ref = hf(**inputs)
        compare(ref, ours(**inputs), name=name)
    if head != "Model":  # lmkit's save: the same settings, and transformers loads it whole with the same outputs
        out = tmp_path_factory.mktemp("ours")
        ours.save_pretrained(out)
        cls = getattr(transformers, CLASS[family] + head)
        same_config(folder, out, cls)
        back, info = cls.from_pretrained(out, output_loading_info=True, **EAGER.get(family, {}))
        assert not info["missing_keys"] and not info["unexpected_keys"] and not info["mismatched_keys"], info
        with torch.no_grad():
            compare(ref, back.eval()(**inputs))
    v4_rope(folder, old_type=data.draw(st.booleans()))
    with torch.no_grad():
        compare(ref, lmkit.load_model(folder)(**inputs), name=name)


@pytest.mark.bf16
@FUZZ
@given(st.data())
def test_half_precision_decoder_folders_load_with_dtype_auto(tmp_path_factory, data):
    """A bf16 or fp16 folder loads in its dtype with dtype="auto", with transformers' logits of the same weights,
    and lmkit saves it back in that dtype."""
    family, _, cfg = data.draw(decoder_configs())
    head = lm_suffix(family)
    dtype = data.draw(st.sampled_from([torch.bfloat16, torch.float16]))
    note(f"{family}{head} {dtype} {cfg.to_diff_dict()}")
    hf = hf_decoder(family, head, cfg, data.draw(st.integers(0, 100))).to(dtype)
    folder = tmp_path_factory.mktemp("half")
    hf.save_pretrained(folder)
    ours = lmkit.load_model(folder, dtype="auto")
    assert {p.dtype for p in ours.parameters()} == {dtype}
    exact = lmkit.load_model(folder)
    ref_model = getattr(transformers, CLASS[family] + head).from_pretrained(folder, dtype=torch.float32,
                                                                    **EAGER.get(family, {})).eval()
    inputs = data.draw(decoder_inputs(cfg))
    with torch.no_grad():
        compare(ref_model(**inputs), exact(**inputs))
    out = tmp_path_factory.mktemp("half_ours")
    ours.save_pretrained(out)
    raw = json.loads((out / "config.json").read_text())
    assert raw["dtype"] == str(dtype).removeprefix("torch.")
    again = lmkit.load_model(out, dtype="auto")
    assert all(torch.equal(a, b) for a, b in zip(ours.state_dict().values(), again.state_dict().values()))


# --- fixed cases the fuzz found ---------------------------------------------------------------------------------------
def small_decoder(family, head, tmp_path, **kw):
    """A folder transformers wrote of a tiny decoder of class CLASS[family] + head."""
    if family == "gpt2":
        cfg = transformers.GPT2Config(vocab_size=30, n_embd=8, n_layer=1, n_head=2, n_positions=16, **kw)
    else:
        cfg = getattr(transformers, CLASS[family] + "Config")(
            vocab_size=30, hidden_size=8, intermediate_size=6, num_hidden_layers=2, num_attention_heads=2,
            num_key_value_heads=1, max_position_embeddings=16, **kw)
    torch.manual_seed(0)
    getattr(transformers, CLASS[family] + head)(cfg).save_pretrained(tmp_path)
    return tmp_path


@pytest.mark.parametrize("family,head", [("gpt2", "ForSequenceClassification"), ("gpt2", "ForTokenClassification"),
                                         ("gpt2", "DoubleHeadsModel"), ("llama", "ForSequenceClassification"),
                                         ("mistral", "ForTokenClassification"), ("qwen2", "ForQuestionAnswering"),
                                         ("mixtral", "ForSequenceClassification")])
def test_decoder_task_head_folders_are_refused_not_loaded_without_their_head(family, head, tmp_path):
    """A classification (or QA, multiple-choice) folder with a tied head used to load as a language model,
    silently dropping its head; config.json's class, or without one the head's tensor, is refused."""
    folder = small_decoder(family, head, tmp_path, tie_word_embeddings=True)
    with pytest.raises(ConfigError, match=head):
        lmkit.load_model(folder)
    raw = json.loads((folder / "config.json").read_text())
    raw.pop("architectures")  # a hand-written config.json: the checkpoint's tensors still tell
    (folder / "config.json").write_text(json.dumps(raw))
    with pytest.raises(ConfigError, match="task head"):
        lmkit.load_model(folder)


@pytest.mark.parametrize("kw", [dict(use_sliding_window=True, sliding_window=3, max_window_layers=2),
                                dict(use_sliding_window=False, sliding_window=5, max_window_layers=0),
                                dict(use_sliding_window=True, sliding_window=3, max_window_layers=1),
                                dict(use_sliding_window=True, sliding_window=3,
                                     layer_types=["sliding_attention", "full_attention"])])
def test_qwen2_window_settings_survive_lmkit_save(kw, tmp_path):
    """A window no layer uses, or a max_window_layers without a window, was written as no window at all /
    max_window_layers = the layer count; config.json's settings are written back as they were."""
    folder = small_decoder("qwen2", "ForCausalLM", tmp_path / "hf", **kw)
    lmkit.load_model(folder).save_pretrained(tmp_path / "ours")
    same_config(folder, tmp_path / "ours", transformers.Qwen2ForCausalLM)


@st.composite
def native_decoders(draw):
    """An lmkit decoder built from a preset with random sizes, in each decoder family's format."""
    from lmkit.config import get_preset
    from lmkit.models import build_model

    family = draw(st.sampled_from(sorted(CLASS)))
    heads = draw(st.integers(1, 4))
    sizes = dict(vocab_size=draw(st.integers(20, 60)), n_layers=draw(st.integers(1, 3)), n_heads=heads,
                 d_model=heads * draw(st.integers(1, 6)), d_ff=draw(st.integers(1, 30)), dropout=0.0,
                 attention_dropout=0.0, max_seq_len=draw(st.integers(12, 30)), tie_embeddings=draw(st.booleans()))
    if family == "gpt2":
        cfg = get_preset("gpt2", **sizes, activation=draw(st.sampled_from(["gelu", "gelu_tanh", "relu", "silu"])))
    else:
        sizes.update(n_kv_heads=draw(st.sampled_from([d for d in range(1, heads + 1) if heads % d == 0])),
                     head_dim=2 * draw(st.integers(1, 4)), family=family,
                     activation=draw(st.sampled_from(["swiglu", "geglu", "geglu_tanh", "reglu"])),
                     norm_eps=draw(st.sampled_from([1e-6, 1e-3])), rope_theta=draw(st.sampled_from([1e4, 500.0])))
        if family == "qwen2":
            sizes.update(attention_bias=True, attention_out_bias=False)
        if family in ("mistral", "qwen2", "mixtral"):
            sizes["sliding_window"] = draw(st.sampled_from([None, 3]))
        if family == "mixtral":
            sizes.update(n_experts=(e := draw(st.integers(1, 4))), n_experts_per_token=draw(st.integers(1, e)))
        cfg = get_preset("moe" if family == "mixtral" else "llama", **sizes)
    model = build_model(cfg)
    torch.manual_seed(0)
    with torch.no_grad():
        for p in model.parameters():
            p.normal_(0, 0.3)
    return family, model.eval()


@FUZZ
@given(st.data())
def test_lmkit_decoders_save_folders_transformers_loads(tmp_path_factory, data):
    """An lmkit decoder of any decoder family, saved, loads in transformers' class without missing or unexpected
    tensors and gives lmkit's logits."""
    family, ours = data.draw(native_decoders())
    note(f"{family} {ours.config}")
    folder = tmp_path_factory.mktemp("native")
    ours.save_pretrained(folder)
    cls = getattr(transformers, CLASS[family] + lm_suffix(family))
    hf, info = cls.from_pretrained(folder, output_loading_info=True, **EAGER.get(family, {}))
    assert not info["missing_keys"] and not info["unexpected_keys"] and not info["mismatched_keys"], info
    inputs = data.draw(decoder_inputs(hf.config))
    with torch.no_grad():
        compare(hf.eval()(**inputs), ours(**inputs))
