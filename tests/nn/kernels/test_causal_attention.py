"""The compiled float32 causal attention for CPU training: forward and backward against the float64 formula,
in the model against SDPA's path, and the fallback when it cannot be built."""
import logging

import pytest
import torch
import torch.nn.functional as F

from lmkit.config import ModelConfig
from helpers.graphs import graph_nodes
from lmkit.nn import Attention, RotaryEmbedding
from lmkit.nn.kernels import causal_attention
from tolerances import assert_close_in


@pytest.fixture
def kernel():
    lib = causal_attention.library()
    assert lib is not None, "the attention kernel did not build here (g++ with OpenMP is part of the setup)"
    return lib


def exact_scores(q, k, scale):
    """Q K^T * scale with the causal mask as -inf, key heads repeated for grouped queries (float64 in, out)."""
    k = k.repeat_interleave(q.shape[1] // k.shape[1], 1)
    t = q.shape[2]
    return (q @ k.transpose(-1, -2) * scale).masked_fill(torch.ones(t, t, dtype=torch.bool).triu(1), float("-inf"))


def exact_attention(q, k, v, scale):
    """softmax(Q K^T * scale + causal mask) V, written out."""
    return exact_scores(q, k, scale).softmax(-1) @ v.repeat_interleave(q.shape[1] // v.shape[1], 1)


def joined(B, T, H, H_kv, D, seed):
    return torch.randn(B, T, (H + 2 * H_kv) * D, generator=torch.Generator().manual_seed(seed)) * 2


# lengths: one block and a bit, no multiple of the block (32) or of the vector width (8), several blocks;
# head sizes below and off the vector width; grouped and single key/value heads
@pytest.mark.parametrize("B,T,H,H_kv,D", [(1, 2, 1, 1, 8), (2, 33, 4, 4, 16), (3, 100, 6, 2, 12),
                                          (2, 257, 4, 1, 64), (1, 96, 2, 2, 80), (2, 65, 3, 3, 5)])
@pytest.mark.parametrize("store", [False, True])
def test_forward_and_backward_match_the_float64_formula(kernel, B, T, H, H_kv, D, store):
    qkv = joined(B, T, H, H_kv, D, seed=T)
    grad = torch.randn(B, H, T, D, generator=torch.Generator().manual_seed(1))
    scale = 0.7 / D ** 0.5
    exact = qkv.double().requires_grad_(True)
    want = exact_attention(*causal_attention._split_heads(exact, H, H_kv), scale)
    want.backward(grad.double())
    q, k, v = causal_attention._split_heads(qkv, H, H_kv)  # strided views of the joined projection, as in the model
    out, lse, probs = causal_attention.attention_forward(q, k, v, scale, store=store)
    assert (probs is not None) == store
    d_qkv = torch.full_like(qkv, float("nan"))  # every entry must be written
    causal_attention.attention_backward(grad, q, k, v, out, lse, probs, scale, *causal_attention._split_heads(d_qkv, H, H_kv))
    # float32 products over at most T keys and D features: a few dozen roundings at the largest magnitude
    assert_close_in(torch.float32, out.transpose(1, 2), want, steps=64)
    assert_close_in(torch.float32, d_qkv, exact.grad, steps=256)
    q64, k64, _ = causal_attention._split_heads(qkv.double(), H, H_kv)
    want_lse = torch.logsumexp(exact_scores(q64, k64, scale), -1)
    assert_close_in(torch.float32, lse, want_lse, steps=64)


@pytest.mark.parametrize("threads", [1, 2])
def test_both_autograd_functions_agree_with_sdpa_on_contiguous_and_strided_inputs(kernel, threads):
    B, T, H, H_kv, D = 3, 70, 4, 2, 16
    qkv = joined(B, T, H, H_kv, D, seed=5).requires_grad_(True)
    grad = torch.randn(B, T, H * D, generator=torch.Generator().manual_seed(2))
    before = torch.get_num_threads()
    torch.set_num_threads(threads)
    try:
        out = causal_attention.JoinedCausalAttention.apply(qkv, H, H_kv, 0.25)
        (d_joined,) = torch.autograd.grad(out, qkv, grad)
        q, k, v = (t.contiguous() for t in causal_attention._split_heads(qkv, H, H_kv))  # rope's outputs are like these
        out_heads = causal_attention.CausalAttention.apply(q, k, v, 0.25)
        d_heads = torch.autograd.grad(out_heads, (q, k, v), grad.view(B, T, H, D).transpose(1, 2))
    finally:
        torch.set_num_threads(before)
    qs, ks, vs = causal_attention._split_heads(qkv, H, H_kv)
    want = F.scaled_dot_product_attention(qs, ks, vs, is_causal=True, scale=0.25, enable_gqa=True)
    (d_want,) = torch.autograd.grad(want.transpose(1, 2).reshape(B, T, H * D), qkv, grad)
    assert_close_in(torch.float32, out, want.transpose(1, 2).reshape(B, T, H * D), steps=64)
    assert_close_in(torch.float32, out_heads, want, steps=64)
    assert_close_in(torch.float32, d_joined, d_want, steps=256)
    d_split = torch.cat([d.transpose(1, 2).reshape(B, T, -1) for d in d_heads], -1)
    assert_close_in(torch.float32, d_split, d_want, steps=256)
    assert out_heads.transpose(1, 2).is_contiguous()  # the heads merge without a copy


def model_config(**kw):
    base = dict(vocab_size=50, d_model=48, n_layers=2, n_heads=4, max_seq_len=64, position="learned",
                activation="gelu_tanh")
    return ModelConfig(**{**base, **kw})


@pytest.mark.parametrize("kw", [dict(), dict(position="rope", n_kv_heads=2, norm="rmsnorm", activation="swiglu")])
def test_attention_layer_training_goes_through_the_kernel_and_matches_sdpa(kernel, monkeypatch, kw):
    torch.manual_seed(0)
    att = Attention(model_config(**kw), causal=True).train()
    x = torch.randn(2, 37, 48, requires_grad=True)
    rope = None
    if kw:
        rope = RotaryEmbedding(att.config)(torch.arange(37)[None], torch.float32)
    out = att(x, is_causal=True, rope=rope)
    expected = "CausalAttentionBackward" if kw else "JoinedCausalAttentionBackward"
    assert expected in graph_nodes(out)
    grads = torch.autograd.grad(out.square().sum(), [x, *att.parameters()])
    monkeypatch.setattr(causal_attention, "_library", False)  # the SDPA path
    assert not causal_attention.applies(x)
    want = att(x, is_causal=True, rope=rope)
    want_grads = torch.autograd.grad(want.square().sum(), [x, *att.parameters()])
    assert_close_in(torch.float32, out, want, steps=64)
    # one scale for all: the key bias's gradient is zero in exact arithmetic (softmax ignores a shift of every
    # score of a row), so alone it would be compared noise against noise
    flat = lambda gs: torch.cat([g.reshape(-1) for g in gs])  # noqa: E731
    assert_close_in(torch.float32, flat(grads), flat(want_grads), steps=512)


def test_inference_padding_dropout_and_low_precision_keep_their_paths(kernel):
    x = torch.randn(2, 9, 8)
    assert causal_attention.applies(x)
    with torch.no_grad():
        assert not causal_attention.applies(x)  # no gradients: SDPA's forward
    assert not causal_attention.applies(x.bfloat16())
    torch.manual_seed(0)
    att = Attention(model_config(attention_dropout=0.1), causal=True).train()
    out = att(torch.randn(2, 9, 48, requires_grad=True), is_causal=True)
    assert not any("CausalAttention" in n for n in graph_nodes(out))
    att.eval()
    assert any("CausalAttention" in n for n in graph_nodes(att(torch.randn(2, 9, 48, requires_grad=True), is_causal=True)))
    padded = torch.ones(2, 1, 9, 9, dtype=torch.bool).tril()
    out = att(torch.randn(2, 9, 48, requires_grad=True), bias=padded)
    assert not any("CausalAttention" in n for n in graph_nodes(out))


def test_without_a_compiler_attention_falls_back_to_sdpa(monkeypatch, tmp_path, caplog):
    monkeypatch.setattr(causal_attention, "_library", None)
    monkeypatch.setenv("LMKIT_CACHE", str(tmp_path))
    monkeypatch.setenv("CXX", str(tmp_path / "no-such-compiler"))
    with caplog.at_level(logging.INFO, logger="lmkit.nn.kernels.causal_attention"):
        assert causal_attention.library() is None
    assert "using SDPA" in caplog.text
    assert not causal_attention.applies(torch.randn(2, 3))
    torch.manual_seed(0)
    att = Attention(model_config(), causal=True).train()
    x = torch.randn(2, 9, 48, requires_grad=True)
    att(x, is_causal=True).sum().backward()  # trains on SDPA
    assert x.grad is not None and torch.isfinite(x.grad).all()


def test_the_library_builds_into_an_empty_cache_and_is_reused(monkeypatch, tmp_path):
    monkeypatch.setattr(causal_attention, "_library", None)
    monkeypatch.setenv("LMKIT_CACHE", str(tmp_path))
    assert causal_attention.library() is not None  # compiled here, and checked against the formula
    built = list((tmp_path / "kernels").glob("causal_attention-*.so"))
    assert len(built) == 1 and not [p for p in (tmp_path / "kernels").iterdir() if p not in built]
    stamp = built[0].stat().st_mtime_ns
    monkeypatch.setattr(causal_attention, "_library", None)
    assert causal_attention.library() is not None
    assert built[0].stat().st_mtime_ns == stamp  # loaded, not rebuilt


def test_a_kernel_with_wrong_numbers_is_not_used(monkeypatch, caplog):
    real = causal_attention.attention_forward

    def off_by_a_bit(*args, **kw):
        out, lse, probs = real(*args, **kw)
        return out * 1.001, lse, probs

    monkeypatch.setattr(causal_attention, "_library", None)
    monkeypatch.setattr(causal_attention, "attention_forward", off_by_a_bit)
    with caplog.at_level(logging.INFO, logger="lmkit.nn.kernels.causal_attention"):
        assert causal_attention.library() is None
    assert "differ from the formula" in caplog.text


def test_lmkit_compile_kernels_0_turns_it_off(monkeypatch):
    monkeypatch.setattr(causal_attention, "_library", None)
    monkeypatch.setenv("LMKIT_COMPILE_KERNELS", "0")
    assert causal_attention.library() is None


def test_inputs_the_kernel_cannot_address_are_refused_not_read(kernel):
    q = torch.randn(1, 2, 5, 4)
    for bad in (q.bfloat16(), q.transpose(2, 3), q[:, :1].expand(1, 3, 5, 4).contiguous()):
        with pytest.raises(ValueError, match="float32 CPU"):
            causal_attention.attention_forward(bad, q, q, 0.5)
    with torch.autocast("cpu", dtype=torch.bfloat16):
        assert not causal_attention.applies(q)  # the projections give bf16 there: the eager/SDPA paths serve it


def test_probabilities_are_kept_only_while_they_are_small():
    assert causal_attention.stores_probabilities(16, 4, 256, 64)  # the benchmark's layer: 16.7 MB
    assert not causal_attention.stores_probabilities(16, 4, 257, 64)  # longer than 4 x the head size
    assert causal_attention.stores_probabilities(64, 4, 256, 64)  # 64 MB: the limit
    assert not causal_attention.stores_probabilities(65, 4, 256, 64)
    q, k, v = causal_attention._split_heads(joined(2, 300, 2, 2, 64, seed=0), 2, 2)
    assert causal_attention.attention_forward(q, k, v, 0.1)[2] is None
