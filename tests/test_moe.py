"""Mixture-of-experts feed-forward: routing, equivalences and the load-balancing loss."""
import math

import torch

from lmkit.config import ModelConfig, get_preset
from lmkit.models import CausalLM
from lmkit.nn.ffn import FeedForward
from lmkit.nn.moe import MoEFeedForward, load_balancing_loss



def cfg(**kw):
    base = dict(vocab_size=61, d_model=24, n_layers=2, n_heads=4, activation="swiglu", bias=False, d_ff=40,
                n_experts=5, n_experts_per_token=2, position="rope", norm="rmsnorm")
    return ModelConfig(**{**base, **kw})


def test_one_expert_equals_dense_ffn():
    torch.manual_seed(0)
    c = cfg(n_experts=1, n_experts_per_token=1)
    moe, dense = MoEFeedForward(c), FeedForward(c)
    dense.load_state_dict(moe.experts[0].state_dict())
    x = torch.randn(3, 7, 24)
    torch.testing.assert_close(moe(x), dense(x), rtol=0, atol=1e-6)


def test_softmax_over_chosen_equals_renormalised_topk():
    torch.manual_seed(1)
    moe = MoEFeedForward(cfg())
    x = torch.randn(11, 24)
    logits, _, weights, chosen = moe.route(x)
    expected = torch.softmax(logits.float().gather(1, chosen), dim=-1)
    torch.testing.assert_close(weights, expected)
    assert torch.allclose(weights.sum(-1), torch.ones(11))


def test_each_token_uses_only_its_chosen_experts():
    torch.manual_seed(2)
    moe = MoEFeedForward(cfg(n_experts=6, n_experts_per_token=2))
    x = torch.randn(1, 9, 24)
    y = moe(x)
    _, _, weights, chosen = moe.route(x.reshape(-1, 24))
    for t in range(9):
        # the output is exactly the weighted sum of its chosen experts ...
        want = sum(weights[t, s] * moe.experts[int(chosen[t, s])](x[0, t:t + 1])[0] for s in range(2))
        torch.testing.assert_close(y[0, t], want, rtol=1e-5, atol=1e-6)
    # ... and changing every expert a token did not choose leaves that token's output unchanged
    for t in (0, 4, 8):
        other = [e for e in range(6) if e not in chosen[t].tolist()]
        changed = MoEFeedForward(cfg(n_experts=6, n_experts_per_token=2))
        changed.load_state_dict(moe.state_dict())
        with torch.no_grad():
            for e in other:
                for p in changed.experts[e].parameters():
                    p.add_(torch.randn_like(p))
        z = changed(x)
        torch.testing.assert_close(z[0, t], y[0, t], rtol=0, atol=0)
        assert not torch.allclose(z, y)


def test_aux_loss_is_minimal_for_uniform_router():
    n, k = 8, 2
    chosen_uniform = torch.arange(64 * k).view(64, k) % n    # balanced assignments
    uniform = torch.full((64, n), 1.0 / n)
    base = load_balancing_loss(uniform, chosen_uniform, n)
    assert math.isclose(float(base), k, rel_tol=1e-6)
    g = torch.Generator().manual_seed(0)
    for scale in (0.5, 2.0, 8.0):
        probs = torch.softmax(scale * torch.randn(64, n, generator=g), -1)
        chosen = probs.topk(k, -1).indices
        assert float(load_balancing_loss(probs, chosen, n)) >= float(base) - 1e-6
    # a collapsed router (every token to the same experts) is penalised the most
    collapsed = torch.softmax(torch.tensor([10.0, 9.0] + [0.0] * (n - 2)).expand(64, n), -1)
    assert float(load_balancing_loss(collapsed, collapsed.topk(k, -1).indices, n)) > 3 * k


def test_aux_loss_reaches_model_output_with_coefficient():
    torch.manual_seed(3)
    c = cfg(router_aux_loss_coef=0.5)
    model = CausalLM(c)
    out = model(torch.randint(0, 61, (2, 6)))
    per_layer = [layer.mlp.sublayer.balance_loss for layer in model.decoder.layers]
    torch.testing.assert_close(out.aux_loss, 0.5 * torch.stack(per_layer).sum())
    out.aux_loss.backward()
    assert model.decoder.layers[0].mlp.sublayer.gate.weight.grad.abs().sum() > 0


def test_capacity_drops_overflow_assignments():
    torch.manual_seed(4)
    c = cfg(n_experts=4, n_experts_per_token=1, expert_capacity_factor=1.0)
    moe = MoEFeedForward(c)
    with torch.no_grad():                     # route every token to expert 0
        moe.gate.weight.zero_()
        moe.gate.weight[0] = 0.0
        moe.gate.weight[0, 0] = 50.0
    x = torch.randn(1, 8, 24).abs()
    y = moe(x)
    capacity = math.ceil(1.0 * 8 * 1 / 4)
    kept = (y[0].abs().sum(-1) > 0).nonzero().flatten().tolist()
    assert kept == list(range(capacity))      # the first tokens fill the capacity, the rest are dropped
    free = MoEFeedForward(cfg(n_experts=4, n_experts_per_token=1))
    free.load_state_dict(moe.state_dict())
    torch.testing.assert_close(y[0, :capacity], free(x)[0, :capacity])


def test_moe_preset_is_mixtral_like():
    c = get_preset("moe", vocab_size=64, d_model=32, n_layers=1, n_heads=4, n_kv_heads=2)
    model = CausalLM(c)
    moe = model.decoder.layers[0].mlp.sublayer
    assert isinstance(moe, MoEFeedForward) and len(moe.experts) == 8 and moe.top_k == 2
    assert moe.experts[0].gate_proj is not None   # SwiGLU experts
