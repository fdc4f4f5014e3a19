"""Tiled online-softmax attention equals the float64 formula, forward and backward, for every mask it takes."""
import pytest
import torch

from lmkit.nn.kernels.tiled_attention import TiledAttention, tiled_attention


def _no_tiles(*args):
    raise AssertionError("the tiles ran where SDPA should have")


def formula(q, k, v, causal, keep, window, scale):
    """softmax(q k^T * scale + mask) v in float64 with the dense mask; rows that see nothing give 0."""
    q, k, v = q.double(), k.double(), v.double()
    rep = q.shape[1] // k.shape[1]
    k, v = k.repeat_interleave(rep, 1), v.repeat_interleave(rep, 1)
    T, S = q.shape[2], k.shape[2]
    qi = torch.arange(T)[:, None] + S - T
    kj = torch.arange(S)[None]
    allowed = torch.ones(T, S, dtype=torch.bool)
    if causal:
        allowed &= kj <= qi
    if window is not None:
        allowed &= qi - kj < window
    allowed = allowed[None, None]
    if keep is not None:
        allowed = allowed & keep[:, None, None, :].bool()
    s = (q @ k.transpose(-1, -2) * scale).masked_fill(~allowed, float("-inf"))
    p = torch.nan_to_num(s.softmax(-1), nan=0.0)
    return p @ v


CASES = [  # (H, H_kv, T, S, causal, padded, window)
    (4, 4, 37, 37, True, False, None),
    (4, 2, 37, 37, False, False, None),
    (6, 2, 45, 45, True, True, None),
    (4, 1, 50, 50, True, False, 9),
    (4, 2, 29, 29, False, True, None),
    (4, 2, 7, 40, True, True, 16),  # queries after 33 cached keys, a window and padding
]


@pytest.mark.parametrize("route", ["cpu-fused", "torch-ops", "sdpa"])
@pytest.mark.parametrize("H, H_kv, T, S, causal, padded, window", CASES)
def test_equals_the_float64_formula_forward_and_backward(monkeypatch, H, H_kv, T, S, causal, padded, window, route):
    """Every path: ATen's CPU flash kernel per key block merged by log-sum-exp, the PyTorch-ops tiles (what
    other devices run), and SDPA, which the default takes at these short lengths (the tiles never run then)."""
    monkeypatch.setattr("lmkit.nn.kernels.tiled_attention._PORTABLE", route == "torch-ops")
    if route == "sdpa":
        monkeypatch.setattr(TiledAttention, "apply", _no_tiles)
    g = torch.Generator().manual_seed(T + S)
    B, D = 3, 16
    q = torch.randn(B, H, T, D, generator=g, requires_grad=True)
    k = torch.randn(B, H_kv, S, D, generator=g, requires_grad=True)
    v = torch.randn(B, H_kv, S, D, generator=g, requires_grad=True)
    keep = None
    if padded:  # left padding of different widths, one row whose first queries see no key at all
        keep = torch.ones(B, S, dtype=torch.bool)
        keep[1, :5] = False
        keep[2, : S - T + 3] = False
    grad = torch.randn(B, H, T, D, generator=g)
    out = tiled_attention(q, k, v, causal, keep, window, 0.3, tile=None if route == "sdpa" else 8)
    out.backward(grad)
    q64, k64, v64 = (t.detach().double().requires_grad_(True) for t in (q, k, v))
    want = formula(q64, k64, v64, causal, keep, window, 0.3)
    want.backward(grad.double())
    eps = torch.finfo(torch.float32).eps
    for got, ref in ((out, want), (q.grad, q64.grad), (k.grad, k64.grad), (v.grad, v64.grad)):
        assert torch.isfinite(got).all()
        assert (got.double() - ref).abs().max() <= 64 * eps * max(ref.abs().max().item(), 1.0)


@pytest.mark.parametrize("portable", [False, True], ids=["cpu-fused", "torch-ops"])
def test_tile_size_changes_nothing_but_rounding(monkeypatch, portable):
    monkeypatch.setattr("lmkit.nn.kernels.tiled_attention._PORTABLE", portable)
    g = torch.Generator().manual_seed(1)
    q, k, v = (torch.randn(2, 4, 100, 8, generator=g) for _ in range(3))
    a = tiled_attention(q, k, v, True, tile=7)
    b = tiled_attention(q, k, v, True, tile=512)
    torch.testing.assert_close(a, b, rtol=1e-5, atol=1e-6)
    torch.testing.assert_close(b, torch.nn.functional.scaled_dot_product_attention(q, k, v, is_causal=True),
                               rtol=1e-5, atol=1e-6)


def test_short_or_unmasked_calls_take_sdpa_and_long_masked_ones_the_tiles(monkeypatch):
    """No user pays for tiling where SDPA is faster: a call with no mask to give takes SDPA at any length on CPU
    (its fused kernel is O(T) there), a masked one while B T S <= SDPA_LIMIT; past it the tiles keep O(T)."""
    from lmkit.nn.kernels import tiled_attention as tiled

    calls = []
    real = TiledAttention.apply
    monkeypatch.setattr(TiledAttention, "apply", lambda *a: calls.append(1) or real(*a))
    monkeypatch.setattr(tiled, "SDPA_LIMIT", 2 * 40 * 40)
    g = torch.Generator().manual_seed(3)
    q, k, v = (torch.randn(2, 4, 41, 8, generator=g) for _ in range(3))
    keep = torch.ones(2, 41, dtype=torch.bool)
    keep[1, :6] = False
    want = formula(q, k, v, True, keep, None, 8 ** -0.5)
    plain = tiled_attention(q, k, v, True)  # past the limit, but nothing to mask
    assert not calls
    torch.testing.assert_close(plain.double(), formula(q, k, v, True, None, None, 8 ** -0.5), rtol=1e-5, atol=1e-5)
    padded = tiled_attention(q, k, v, True, keep)  # past the limit, padded: the tiles
    assert len(calls) == 1
    torch.testing.assert_close(padded.double(), want, rtol=1e-5, atol=1e-5)
    monkeypatch.setattr(tiled, "SDPA_LIMIT", 2 * 41 * 41)  # at the limit: SDPA with the mask spelled out
    torch.testing.assert_close(tiled_attention(q, k, v, True, keep).double(), want, rtol=1e-5, atol=1e-5)
    tiled_attention(q, k, v, True, None, window=41)  # a window that hides no key is no mask
    tiled_attention(q[:, :, 1:], k, v, False)  # bidirectional after cached keys: no mask either
    assert len(calls) == 1


def test_bad_shapes_are_refused():
    q = torch.randn(1, 3, 4, 8)
    with pytest.raises(ValueError, match="multiple of H_kv"):
        tiled_attention(q, torch.randn(1, 2, 4, 8), torch.randn(1, 2, 4, 8))


@pytest.mark.parametrize("window", [None, 6])
def test_a_model_attends_through_the_tiles_where_a_dense_mask_would_be_large(monkeypatch, window):
    """The same logits and gradients as the dense mask for padded rows and sliding windows, GQA included."""
    from lmkit.config import get_preset
    from lmkit.models import build_model
    from lmkit.nn.kernels import tiled_attention as tiled

    cfg = get_preset("tiny", vocab_size=97, max_seq_len=64, position="rope", n_heads=4, n_kv_heads=2,
                     sliding_window=window, dropout=0.0, attention_dropout=0.0)
    torch.manual_seed(0)
    model = build_model(cfg)
    ids = torch.randint(0, 97, (3, 23))
    mask = torch.ones(3, 23, dtype=torch.long)
    mask[1, :4] = 0
    mask[2, :9] = 0
    calls = []
    real = tiled.tiled_attention
    monkeypatch.setattr("lmkit.nn.attention.tiled_attention", lambda *a, **k: calls.append(1) or real(*a, **k))

    monkeypatch.setattr(tiled, "SDPA_LIMIT", 0)  # the tiles themselves, not SDPA's short-length stand-in

    def run(limit):
        monkeypatch.setattr("lmkit.models.stack.DENSE_MASK_LIMIT", limit)
        model.zero_grad()
        logits = model(ids, attention_mask=mask).logits
        (logits * mask[..., None]).sum().backward()
        return logits.detach(), [p.grad.clone() for p in model.parameters()]

    dense_logits, dense_grads = run(1 << 40)
    assert not calls
    logits, grads = run(0)
    assert len(calls) == cfg.n_layers
    real_rows = mask.bool()
    torch.testing.assert_close(logits[real_rows], dense_logits[real_rows], rtol=1e-5, atol=1e-5)
    for got, want in zip(grads, dense_grads):
        torch.testing.assert_close(got, want, rtol=1e-4, atol=1e-5)
    with torch.no_grad():  # the last block at kept positions alone spells the mask out (StructuredMask.dense)
        last = model(ids, attention_mask=mask, logits_to_keep=1).logits
    torch.testing.assert_close(last[:, -1], dense_logits[:, -1], rtol=1e-5, atol=1e-5)
