"""Attention: the softmax formula, masks, permutation equivariance, GQA/MQA and the KV cache."""
import math

import pytest
import torch

from lmkit.config import ModelConfig
from lmkit.nn import Attention, KVCache, RotaryEmbedding, build_attention_bias
from tolerances import assert_close_in, assert_close_in_norm




def cfg(**kw) -> ModelConfig:
    base = dict(vocab_size=11, d_model=24, n_layers=1, n_heads=4, max_seq_len=32, position="none")
    return ModelConfig(**{**base, **kw})


def attention(causal: bool, **kw) -> Attention:
    torch.manual_seed(0)
    att = Attention(cfg(**kw), causal=causal)
    for p in att.parameters():
        torch.nn.init.normal_(p, std=0.3)
    return att.eval()


def reference(att: Attention, x: torch.Tensor, allowed: torch.Tensor | None = None) -> torch.Tensor:
    """softmax(Q K^T / sqrt(d_head) + mask) V per head, written out, with kv heads repeated for GQA."""
    B, T, _ = x.shape
    H, Hkv, D = att.n_heads, att.n_kv_heads, att.head_dim
    q = att.q_proj(x).view(B, T, H, D).transpose(1, 2)
    k = att.k_proj(x).view(B, T, Hkv, D).transpose(1, 2).repeat_interleave(H // Hkv, dim=1)
    v = att.v_proj(x).view(B, T, Hkv, D).transpose(1, 2).repeat_interleave(H // Hkv, dim=1)
    scores = q @ k.transpose(-1, -2) / math.sqrt(D)
    if allowed is not None:
        scores = scores.masked_fill(~allowed, float("-inf"))
    out = scores.softmax(-1) @ v
    return att.o_proj(out.transpose(1, 2).reshape(B, T, H * D))


@pytest.mark.parametrize("n_kv_heads", [None, 2, 1])
def test_attention_equals_the_softmax_formula(n_kv_heads):
    att = attention(causal=False, n_kv_heads=n_kv_heads)
    x = torch.randn(2, 5, 24)
    torch.testing.assert_close(att(x), reference(att, x), atol=1e-5, rtol=1e-5)
    causal = torch.ones(5, 5, dtype=torch.bool).tril()
    torch.testing.assert_close(att(x, is_causal=True), reference(att, x, causal), atol=1e-5, rtol=1e-5)


def test_gqa_equals_mha_with_each_kv_head_repeated():
    gqa = attention(causal=True, n_kv_heads=2)
    mha = Attention(cfg(), causal=True).eval()
    with torch.no_grad():
        mha.q_proj.weight.copy_(gqa.q_proj.weight)
        mha.q_proj.bias.copy_(gqa.q_proj.bias)
        mha.o_proj.load_state_dict(gqa.o_proj.state_dict())
        for name in ("k_proj", "v_proj"):
            w = getattr(gqa, name).weight.view(2, 6, 24).repeat_interleave(2, dim=0).reshape(24, 24)
            b = getattr(gqa, name).bias.view(2, 6).repeat_interleave(2, dim=0).reshape(24)
            getattr(mha, name).weight.copy_(w)
            getattr(mha, name).bias.copy_(b)
    x = torch.randn(3, 6, 24)
    torch.testing.assert_close(gqa(x, is_causal=True), mha(x, is_causal=True), atol=1e-5, rtol=1e-5)
    assert gqa.k_proj.out_features == 12 and attention(causal=True, n_kv_heads=1).k_proj.out_features == 6


def test_without_positions_attention_is_permutation_equivariant():
    att = attention(causal=False, n_kv_heads=2)
    x = torch.randn(2, 7, 24)
    perm = torch.randperm(7)
    torch.testing.assert_close(att(x[:, perm]), att(x)[:, perm], atol=1e-5, rtol=1e-5)


def test_causal_position_t_never_sees_t_plus_1():
    att = attention(causal=True)
    x = torch.randn(1, 8, 24)
    for t in range(7):
        y = x.clone()
        y[:, t + 1:] = torch.randn(1, 7 - t, 24) * 10
        torch.testing.assert_close(att(y, is_causal=True)[:, :t + 1], att(x, is_causal=True)[:, :t + 1])
    # and the gradient of output t with respect to input t+1 is exactly zero
    x.requires_grad_(True)
    out = att(x, is_causal=True)
    out[0, 3].sum().backward()
    assert x.grad[0, 4:].abs().max() == 0 and x.grad[0, :4].abs().max() > 0


def test_the_causal_mask_built_for_a_cache_lets_query_i_see_keys_up_to_past_plus_i():
    mask, is_causal = build_attention_bias(torch.ones(1, 6), 1, 2, 6, True, torch.float32, torch.device("cpu"))
    assert not is_causal
    assert mask[0, 0].tolist() == [[True] * 5 + [False], [True] * 6]
    assert build_attention_bias(None, 2, 4, 4, True, torch.float32, torch.device("cpu")) == (None, True)


def test_padded_keys_change_nothing():
    att = attention(causal=True)
    x = torch.randn(2, 6, 24)
    pad = torch.tensor([[1, 1, 1, 1, 0, 0], [0, 0, 1, 1, 1, 1]])
    mask, is_causal = build_attention_bias(pad, 2, 6, 6, True, torch.float32, torch.device("cpu"))
    out = att(x, bias=mask, is_causal=is_causal)
    junk = x.clone()
    junk[0, 4:] = 50 * torch.randn(2, 24)
    junk[1, :2] = 50 * torch.randn(2, 24)
    again = att(junk, bias=mask, is_causal=is_causal)
    torch.testing.assert_close(again[0, :4], out[0, :4])
    torch.testing.assert_close(again[1, 2:], out[1, 2:])
    # a right-padded row equals the same row alone; a left-padded row equals its real tokens alone
    torch.testing.assert_close(out[0, :4], att(x[:1, :4], is_causal=True)[0], atol=1e-5, rtol=1e-5)
    torch.testing.assert_close(out[1, 2:], att(x[1:, 2:], is_causal=True)[0], atol=1e-5, rtol=1e-5)


@pytest.mark.parametrize("n_kv_heads", [None, 2, 1])
def test_kv_cache_incremental_equals_full_recomputation(n_kv_heads):
    att = attention(causal=True, n_kv_heads=n_kv_heads, position="rope")
    rotary = RotaryEmbedding(att.config)
    x = torch.randn(2, 9, 24)
    pos = torch.arange(9)[None].expand(2, 9)
    full = att(x, is_causal=True, rope=rotary(pos, torch.float32))
    cache = KVCache()
    pieces, start = [], 0
    for size in (4, 1, 1, 3):  # a prompt, single steps, then a chunk
        sl = slice(start, start + size)
        mask, is_causal = build_attention_bias(None, 2, size, start + size, True, torch.float32, x.device)
        pieces.append(att(x[:, sl], bias=mask, is_causal=is_causal, rope=rotary(pos[:, sl], torch.float32),
                          cache=cache, layer=0))
        start += size
    assert cache.get_seq_length(0) == 9
    torch.testing.assert_close(torch.cat(pieces, 1), full, atol=1e-5, rtol=1e-5)


def test_kv_cache_grows_past_its_capacity_and_reorders_rows():
    cache = KVCache()
    ks = [torch.randn(3, 2, 1, 4) for _ in range(70)]
    for k in ks:
        keys, values = cache.update(0, k, -k)
    assert keys.shape == (3, 2, 70, 4)
    torch.testing.assert_close(keys, torch.cat(ks, 2))
    torch.testing.assert_close(values, -torch.cat(ks, 2))
    cache.reorder(torch.tensor([2, 2, 0]))
    keys, _ = cache.update(0, torch.zeros(3, 2, 1, 4), torch.zeros(3, 2, 1, 4))
    torch.testing.assert_close(keys[:, :, :70], torch.cat(ks, 2)[[2, 2, 0]])


@pytest.mark.parametrize("n_kv_heads", [4, 2, 1])
def test_eager_attention_used_for_bf16_training_equals_sdpa(n_kv_heads):
    """The bf16-training path on CPU (matrix products, float32 softmax) computes SDPA's numbers."""
    from lmkit.nn.kernels.eager_attention import eager_attention

    torch.manual_seed(0)
    q = torch.randn(2, 4, 5, 8)
    k, v = torch.randn(2, n_kv_heads, 7, 8), torch.randn(2, n_kv_heads, 7, 8)
    F = torch.nn.functional
    gqa = n_kv_heads != 4
    # causal with 2 cached keys: query i sees keys 0..i+2
    expected = F.scaled_dot_product_attention(q, k, v, attn_mask=torch.ones(5, 7, dtype=torch.bool).tril(2),
                                              enable_gqa=gqa)
    torch.testing.assert_close(eager_attention(q, k, v, None, True, None), expected, atol=1e-5, rtol=1e-5)
    allowed = torch.rand(2, 1, 5, 7) > 0.3
    allowed[..., 0] = True
    expected = F.scaled_dot_product_attention(q, k, v, attn_mask=allowed, scale=0.3, enable_gqa=gqa)
    torch.testing.assert_close(eager_attention(q, k, v, allowed, False, 0.3), expected, atol=1e-5, rtol=1e-5)
    # a row that sees nothing is uniform, not NaN
    allowed[0, 0, 1] = False
    out = eager_attention(q, k, v, allowed, False, None)
    torch.testing.assert_close(out[0, :, 1], v.repeat_interleave(4 // n_kv_heads, 1)[0].mean(-2))


@pytest.mark.parametrize("length", [1, 64, 65, 128, 300, 515])
def test_block_causal_attention_equals_sdpa_with_gradients(length):
    """Causal eager attention in query blocks (the masked keys right of each block never computed):
    values and gradients equal SDPA's causal attention, odd lengths and a lone partial block included."""
    from lmkit.nn.kernels.eager_attention import eager_attention

    torch.manual_seed(0)
    q, k, v = (torch.randn(2, 3, length, 8, requires_grad=True) for _ in range(3))
    grad = torch.randn(2, 3, length, 8)
    got = eager_attention(q, k, v, None, True, None)
    assert type(got.grad_fn).__name__ == "BlockCausalAttentionBackward"
    got_grads = torch.autograd.grad(got, (q, k, v), grad)
    want = torch.nn.functional.scaled_dot_product_attention(q, k, v, is_causal=True)
    want_grads = torch.autograd.grad(want, (q, k, v), grad)
    torch.testing.assert_close(got, want, atol=1e-5, rtol=1e-5)
    for a, b in zip(got_grads, want_grads):
        torch.testing.assert_close(a, b, atol=1e-5, rtol=1e-5)


@pytest.mark.parametrize("length, block", [(7, 3), (6, 3), (5, 8), (9, 1)])
def test_block_causal_attention_gradcheck(length, block):
    """The hand-written backward (dP = dO V^T, dS = P (dP - rowsum(dP P)), dQ, dK, dV) against finite differences."""
    from lmkit.nn.kernels.eager_attention import BlockCausalAttention

    torch.manual_seed(0)
    # q and k as strided views of one projection, as the attention module passes them
    qkv = torch.randn(2, length, 3, 2, 4, dtype=torch.float64, requires_grad=True)
    def fn(qkv):
        q, k, v = (qkv[:, :, i].transpose(1, 2) for i in range(3))
        return BlockCausalAttention.apply(q, k, v, 0.37, block)
    assert torch.autograd.gradcheck(fn, (qkv,))


@pytest.mark.bf16
def test_bf16_training_attention_takes_the_block_path_and_matches_fp32(monkeypatch):
    from lmkit.nn.kernels.eager_attention import BlockCausalAttention

    calls = []
    apply = BlockCausalAttention.apply
    monkeypatch.setattr(BlockCausalAttention, "apply", lambda *a: calls.append(a[0].dtype) or apply(*a))
    torch.manual_seed(0)
    att = attention(causal=True, n_kv_heads=2).train()
    x = torch.randn(2, 70, 24, requires_grad=True)
    with torch.autocast("cpu", dtype=torch.bfloat16):
        low = att(x, is_causal=True)
    assert calls == [torch.bfloat16]
    (low_grad,) = torch.autograd.grad(low.float().square().sum(), x)
    high = att(x, is_causal=True)
    (high_grad,) = torch.autograd.grad(high.square().sum(), x)
    assert_close_in_norm(torch.bfloat16, low, high, steps=3)
    assert_close_in_norm(torch.bfloat16, low_grad, high_grad, steps=3)


@pytest.mark.bf16
def test_bf16_autocast_training_matches_fp32():
    att = attention(causal=True, n_kv_heads=2).train()
    x = torch.randn(2, 16, 24)
    with torch.autocast("cpu", dtype=torch.bfloat16):
        low = att(x, is_causal=True)
    assert low.dtype == torch.bfloat16
    assert_close_in(torch.bfloat16, low, att(x, is_causal=True), steps=3)


def test_fused_inference_projection_follows_weight_updates():
    """Without gradients q/k/v come from one cached fused matrix; it must track in-place weight changes."""
    att = attention(causal=True, n_kv_heads=2)
    x = torch.randn(2, 5, 24)
    with torch.no_grad():
        before = att(x, is_causal=True)
        torch.testing.assert_close(before, reference(att, x, torch.ones(5, 5, dtype=torch.bool).tril()),
                                   atol=1e-5, rtol=1e-5)
        att.k_proj.weight.mul_(2.0)  # an optimizer step or load_state_dict changes weights in place
        att.v_proj.bias.add_(1.0)
        after = att(x, is_causal=True)
        torch.testing.assert_close(after, reference(att, x, torch.ones(5, 5, dtype=torch.bool).tril()),
                                   atol=1e-5, rtol=1e-5)
    assert not torch.allclose(before, after)
    with torch.enable_grad():
        torch.testing.assert_close(att(x, is_causal=True), after, atol=1e-5, rtol=1e-5)
