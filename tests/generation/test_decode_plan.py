"""The lean decoding step (generation/decode_plan.py) computes what the modules compute.

Each case feeds a prompt through the modules, then one more token through `DecodePlan.step`, and
compares the logits with a full forward pass over prompt + token; `generate` with and without the
plan must choose the same ids (greedy, seeded sampling, beam search, padded batches); sliding-window
layers (one window on every layer, or on some) see the last W keys, past the window here. Models the
plan does not reproduce (mixtures of experts, LoRA, forward hooks) must decode through the modules.
"""
import contextlib

import pytest
import torch
import torch.nn.functional as F

from lmkit import CausalLM, get_preset
from lmkit.generation import decode_plan
from lmkit.generation.decode_plan import DecodePlan, projection
from lmkit.nn import KVCache, build_attention_bias
from tolerances import assert_close_in

SMALL = dict(vocab_size=53, max_seq_len=64)
CONFIGS = {
    "gpt2-odd": get_preset("gpt2", d_model=40, n_layers=3, n_heads=5, **SMALL),
    "llama-gqa": get_preset("llama", d_model=48, n_layers=2, n_heads=6, n_kv_heads=2, **SMALL),
    "llama-mqa-linear-rope": get_preset("llama", d_model=32, n_layers=2, n_heads=4, n_kv_heads=1,
                                        rope_scaling={"type": "linear", "factor": 2.0}, **SMALL),
    "llama-dynamic-rope": get_preset("llama", d_model=32, n_layers=2, n_heads=2, n_kv_heads=2,
                                     rope_scaling={"type": "dynamic", "factor": 2.0}, **{**SMALL, "max_seq_len": 12}),
    "transformer-2017": get_preset("transformer-2017", d_model=36, n_layers=2, n_heads=3, **SMALL),
    "qwen2-qkv-bias": get_preset("llama", d_model=36, n_layers=2, n_heads=6, n_kv_heads=2, head_dim=10,
                                 attention_bias=True, attention_out_bias=False, family="qwen2", **SMALL),
    "sandwich-no-bias": get_preset("gpt2", d_model=32, n_layers=2, n_heads=4, norm_placement="sandwich", bias=False,
                                   output_scale=0.5, **SMALL),
    "peri-rms": get_preset("llama", d_model=32, n_layers=2, n_heads=4, n_kv_heads=2, norm_placement="peri", **SMALL),
    "mistral-window3": get_preset("llama", d_model=32, n_layers=2, n_heads=4, n_kv_heads=2, sliding_window=3,
                                  family="mistral", **SMALL),
    "qwen2-layers-0-2-of-3-slide-4": get_preset("llama", d_model=36, n_layers=3, n_heads=6, n_kv_heads=2, head_dim=10,
                                                attention_bias=True, attention_out_bias=False, sliding_window=4,
                                                sliding_layers=[0, 2], family="qwen2", **SMALL),
}


def model_for(config) -> CausalLM:
    torch.manual_seed(0)
    model = CausalLM(config).eval()
    with torch.no_grad():  # peaky but not degenerate next-token distributions
        for name, p in model.named_parameters():
            if p.dim() > 1:
                p.normal_(0, 0.3)
            elif name.endswith(".bias"):  # nonzero biases, so a plan that dropped one would show
                p.normal_(0, 0.3)
    return model


@contextlib.contextmanager
def threads(n: int):
    before = torch.get_num_threads()
    torch.set_num_threads(n)
    try:
        yield
    finally:
        torch.set_num_threads(before)


@contextlib.contextmanager
def without_plan(monkeypatch):
    with monkeypatch.context() as m:
        m.setattr(DecodePlan, "build", classmethod(lambda cls, model, batch: None))
        yield


@pytest.mark.parametrize("n_threads", [1, 2])
@pytest.mark.parametrize("batch", [1, 3])
@pytest.mark.parametrize("name", list(CONFIGS))
@torch.inference_mode()
def test_one_plan_step_equals_the_full_forward_pass(name, batch, n_threads):
    model = model_for(CONFIGS[name])
    ids = torch.randint(0, 53, (batch, 9), generator=torch.Generator().manual_seed(batch))
    with threads(n_threads):
        plan = DecodePlan.build(model, batch)
        assert plan is not None
        cache = KVCache()
        model(ids[:, :-1], past_key_values=cache, use_cache=True)
        got = plan.step(ids[:, -1:], cache, torch.full((batch, 1), 8), None)
        want = model(ids).logits[:, -1]
    torch.testing.assert_close(got, want, atol=2e-5, rtol=1e-5)
    assert cache.get_seq_length() == 9


@pytest.mark.parametrize("name", list(CONFIGS))
@torch.inference_mode()
def test_a_plan_step_on_a_left_padded_batch_equals_the_masked_forward_pass(name):
    model = model_for(CONFIGS[name])
    ids = torch.randint(0, 53, (3, 8), generator=torch.Generator().manual_seed(1))
    mask = torch.ones_like(ids)
    mask[1, :3] = 0
    mask[2, :5] = 0
    positions = (mask.cumsum(-1) - 1).clamp(min=0)
    with threads(2):
        plan = DecodePlan.build(model, 3)
        cache = KVCache()
        model(ids[:, :-1], attention_mask=mask[:, :-1], position_ids=positions[:, :-1], past_key_values=cache,
              use_cache=True)
        bias, _ = build_attention_bias(mask, 3, 1, 8, True, torch.bool, ids.device)
        got = plan.step(ids[:, -1:], cache, positions[:, -1:], bias)
        want = model(ids, attention_mask=mask, position_ids=positions).logits[:, -1]
    torch.testing.assert_close(got, want, atol=2e-5, rtol=1e-5)


@pytest.mark.parametrize("n_threads", [1, 2])
@pytest.mark.parametrize("batch", [1, 3])
@pytest.mark.parametrize("name", [n for n in CONFIGS if "window" not in n and "slide" not in n])
@torch.inference_mode()
def test_a_plan_step_over_several_tokens_with_holes_equals_the_masked_forward_pass(name, batch, n_threads):
    """Drafted tokens checked at once (generation/prompt_lookup.py): t tokens a row, causal among them, over a
    left-padded cache with masked columns (holes) and positions that skip them; every position's logits and
    the cache's new keys are the modules' (the batch-1 plan on 2 threads splits its products by outputs)."""
    model = model_for(CONFIGS[name])
    ids = torch.randint(0, 53, (batch, 11), generator=torch.Generator().manual_seed(3))
    mask = torch.ones_like(ids)
    mask[:, 4] = 0  # a hole every row has
    if batch > 1:
        mask[1, :3] = 0
        mask[2, 6] = 0
    positions = (mask.cumsum(-1) - 1).clamp(min=0)
    with threads(n_threads):
        plan = DecodePlan.build(model, batch)
        cache, ref_cache = KVCache(), KVCache()
        for c in (cache, ref_cache):
            model(ids[:, :7], attention_mask=mask[:, :7], position_ids=positions[:, :7], past_key_values=c,
                  use_cache=True)
        bias, _ = build_attention_bias(mask, batch, 4, 11, True, torch.bool, ids.device)
        got = plan.step(ids[:, 7:], cache, positions[:, 7:], bias)
        want = model(ids[:, 7:], attention_mask=mask, position_ids=positions[:, 7:], past_key_values=ref_cache,
                     use_cache=True).logits
    assert got.shape == want.shape == (batch, 4, 53)
    torch.testing.assert_close(got, want, atol=2e-5, rtol=1e-5)
    for layer in ref_cache.keys:  # float32 products of other shapes: rounding of keys as large as 45
        torch.testing.assert_close(cache.keys[layer][:, :, :11], ref_cache.keys[layer][:, :, :11], atol=1e-4, rtol=1e-5)


@pytest.mark.parametrize("name", ["gpt2-odd", "llama-gqa", "transformer-2017", "qwen2-qkv-bias", "mistral-window3",
                                  "qwen2-layers-0-2-of-3-slide-4"])
@pytest.mark.parametrize("options", [dict(), dict(do_sample=True, top_k=10), dict(num_beams=3)],
                         ids=["greedy", "sampling", "beams"])
def test_generate_chooses_the_same_ids_with_and_without_the_plan(name, options, monkeypatch):
    model = model_for(CONFIGS[name])
    ids = torch.randint(0, 53, (2, 6), generator=torch.Generator().manual_seed(2))
    mask = torch.ones_like(ids)
    mask[1, :2] = 0
    steps = []
    step = DecodePlan.step
    monkeypatch.setattr(DecodePlan, "step", lambda self, *a: steps.append(1) or step(self, *a))
    runs = []
    for use_plan in (True, False):
        with threads(2), (contextlib.nullcontext() if use_plan else without_plan(monkeypatch)):
            torch.manual_seed(5)
            runs.append(model.generate(ids, attention_mask=mask, max_new_tokens=14, eos_token_id=[], **options))
            torch.manual_seed(5)
            runs.append(model.generate(ids[:1], max_new_tokens=14, eos_token_id=[], **options))
    assert torch.equal(runs[0], runs[2]) and torch.equal(runs[1], runs[3])
    assert len(steps) == 2 * 13  # with the plan, every token after the first came from DecodePlan.step


@pytest.mark.bf16
@torch.inference_mode()
def test_a_bfloat16_model_decodes_through_the_plan_too():
    model = model_for(CONFIGS["llama-gqa"]).to(torch.bfloat16)
    ids = torch.randint(0, 53, (2, 9), generator=torch.Generator().manual_seed(4))
    plan = DecodePlan.build(model, 2)
    cache = KVCache()
    model(ids[:, :-1], past_key_values=cache, use_cache=True)
    got = plan.step(ids[:, -1:], cache, torch.full((2, 1), 8), None)
    assert got.dtype == torch.bfloat16
    assert_close_in(torch.bfloat16, got, model(ids).logits[:, -1], steps=3)


@pytest.mark.parametrize("batch, n_threads", [(1, 1), (1, 2), (4, 2), (1, 3), (4, 1), (9, 1)])
@pytest.mark.parametrize("shape", [(24, 40), (40, 24), (7, 16), (1024, 1024)])
@pytest.mark.parametrize("with_bias", [True, False])
def test_every_projection_kernel_computes_x_w_transposed_plus_b(batch, n_threads, shape, with_bias):
    torch.manual_seed(0)
    weight, bias = torch.randn(shape) / shape[1] ** 0.5, torch.randn(shape[0]) if with_bias else None  # O(1) outputs
    x = torch.randn(batch, shape[1])
    with threads(n_threads):
        fn, args = projection(weight, bias, batch, relayout=True)
        got = fn(x, *args)
    if batch == 1 and n_threads > 1 and shape[0] % n_threads == 0:
        expected = decode_plan._split_matvec
    elif batch > 1 and n_threads == 1 and decode_plan.intel_cpu() and (
            batch <= decode_plan.MKL_SMALL_BATCH or batch * weight.numel() <= decode_plan.MKL_SMALL_WORK):
        expected = decode_plan._addmm_t
    elif batch > 1:
        expected = decode_plan._onednn_linear
    else:
        expected = decode_plan._addmm_t if shape[0] > shape[1] else F.linear
    assert fn is expected  # each case takes the kernel the docstring names
    torch.testing.assert_close(got, F.linear(x, weight, bias), atol=1e-5, rtol=1e-5)


def test_models_the_plan_does_not_reproduce_decode_through_their_modules():
    from lmkit.peft import apply_ia3, apply_lora, apply_prefix, quantize_linears

    moe = CausalLM(get_preset("moe", d_model=32, n_layers=1, n_heads=2, n_kv_heads=1, **SMALL)).eval()
    assert DecodePlan.build(moe, 1) is None
    for wrap in (lambda m: apply_lora(m, ["q_proj", "v_proj"], r=2), lambda m: apply_lora(m, ["down_proj"], r=2),
                 apply_ia3, quantize_linears, lambda m: apply_prefix(m, 3)):
        model = model_for(CONFIGS["llama-gqa"])
        wrap(model)
        assert DecodePlan.build(model.eval(), 1) is None
    hooked = model_for(CONFIGS["gpt2-odd"])
    calls = []
    hooked.decoder.layers[1].mlp.sublayer.register_forward_hook(lambda m, i, o: calls.append(1))
    assert DecodePlan.build(hooked, 1) is None
    hooked.generate(torch.tensor([[3, 4, 5]]), max_new_tokens=4, eos_token_id=[])
    assert len(calls) == 4  # the prompt, then every new token but the last went through the hooked module
    assert DecodePlan.build(model_for(CONFIGS["gpt2-odd"]).train(), 1) is None


def test_a_head_pruned_model_decodes_through_the_plan(monkeypatch):
    from lmkit.compress.prune import prune_heads

    model = model_for(CONFIGS["llama-gqa"])
    prune_heads(model, {"decoder.layers.0.self_attn.sublayer": [0, 1, 2]})
    ids = torch.randint(0, 53, (2, 5), generator=torch.Generator().manual_seed(6))
    assert DecodePlan.build(model, 2) is not None
    with_plan = model.generate(ids, max_new_tokens=8, eos_token_id=[])
    with without_plan(monkeypatch):
        assert torch.equal(with_plan, model.generate(ids, max_new_tokens=8, eos_token_id=[]))


def test_big_models_keep_their_weights_as_they_are(monkeypatch):
    monkeypatch.setattr(decode_plan, "RELAYOUT_LIMIT", 0)
    model = model_for(CONFIGS["gpt2-odd"])
    plan = DecodePlan.build(model, 1)
    fn, (weight, _) = plan.layers[0].o_proj
    assert fn is F.linear and weight.data_ptr() == model.decoder.layers[0].self_attn.sublayer.o_proj.weight.data_ptr()
    ids = torch.tensor([[3, 4, 5, 6]])
    with torch.inference_mode():
        cache = KVCache()
        model(ids[:, :-1], past_key_values=cache, use_cache=True)
        torch.testing.assert_close(plan.step(ids[:, -1:], cache, torch.full((1, 1), 3), None),
                                   model(ids).logits[:, -1], atol=2e-5, rtol=1e-5)


def test_a_plan_follows_weights_changed_in_place_or_replaced(monkeypatch):
    model = model_for(CONFIGS["gpt2-odd"])
    ids = torch.tensor([[3, 4, 5, 6]])

    def both() -> tuple[torch.Tensor, torch.Tensor]:
        with_plan = model.generate(ids, max_new_tokens=10, eos_token_id=[])
        with without_plan(monkeypatch):
            return with_plan, model.generate(ids, max_new_tokens=10, eos_token_id=[])

    first = both()
    with torch.no_grad():
        model.decoder.layers[0].mlp.sublayer.up_proj.weight.mul_(-1)
    second = both()
    model.decoder.layers[1].self_attn.sublayer.q_proj.weight = torch.nn.Parameter(torch.randn(40, 40))
    third = both()
    assert not torch.equal(first[0], second[0]) and not torch.equal(second[0], third[0])
    for with_plan, modules in (first, second, third):
        assert torch.equal(with_plan, modules)


@pytest.mark.bf16
@torch.inference_mode()
def test_a_plan_step_under_bfloat16_autocast_equals_the_modules_under_autocast():
    model = model_for(CONFIGS["llama-gqa"])
    ids = torch.randint(0, 53, (2, 9), generator=torch.Generator().manual_seed(8))
    with torch.autocast("cpu", dtype=torch.bfloat16):
        plan = DecodePlan.build(model, 2)
        cache = KVCache()
        model(ids[:, :-1], past_key_values=cache, use_cache=True)
        got = plan.step(ids[:, -1:], cache, torch.full((2, 1), 8), None)
        module_cache = KVCache()
        model(ids[:, :-1], past_key_values=module_cache, use_cache=True)
        want = model(ids[:, -1:], past_key_values=module_cache, use_cache=True).logits[:, -1]
    assert got.dtype == want.dtype
    assert_close_in(torch.bfloat16, got, want, steps=3)  # the same ops, fused differently
