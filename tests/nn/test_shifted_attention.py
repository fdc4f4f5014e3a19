"""S2-Attn (LongLoRA): full causal attention within each group, the shifted half of the heads bridging groups."""
import pytest
import torch

from lmkit.config import get_preset
from lmkit.errors import ConfigError
from lmkit.finetune.longlora import shifted_attention
from lmkit.models import build_model
from lmkit.nn.shifted_attention import shifted_sparse_attention


def causal(q, k, v):
    """softmax(q k^T / sqrt(d) + causal mask) v in float64."""
    q, k, v = q.double(), k.double(), v.double()
    s = q @ k.transpose(-1, -2) / q.shape[-1] ** 0.5
    s = s.masked_fill(torch.ones(s.shape[-2:], dtype=torch.bool).triu(1), float("-inf"))
    return s.softmax(-1) @ v


def qkv(B=2, H=4, Hkv=4, T=24, D=8, seed=0):
    g = torch.Generator().manual_seed(seed)
    return (torch.randn(B, H, T, D, generator=g), torch.randn(B, Hkv, T, D, generator=g),
            torch.randn(B, Hkv, T, D, generator=g))


@pytest.mark.parametrize("H, Hkv", [(4, 4), (6, 2)])
def test_each_group_is_full_causal_attention_over_its_own_positions(H, Hkv):
    G, T = 6, 24
    q, k, v = qkv(H=H, Hkv=Hkv, T=T)
    out = shifted_sparse_attention(q, k, v, G)
    rep = H // Hkv
    k, v = k.repeat_interleave(rep, 1), v.repeat_interleave(rep, 1)
    for g in range(T // G):  # the first half of the heads: groups [gG, (g+1)G)
        s = slice(g * G, (g + 1) * G)
        torch.testing.assert_close(out[:, : H // 2, s].double(), causal(q[:, : H // 2, s], k[:, : H // 2, s],
                                                                       v[:, : H // 2, s]), rtol=1e-5, atol=1e-6)
    for g in range(T // G - 1):  # the shifted half: groups [gG + G/2, (g+1)G + G/2)
        s = slice(g * G + G // 2, (g + 1) * G + G // 2)
        torch.testing.assert_close(out[:, H // 2:, s].double(), causal(q[:, H // 2:, s], k[:, H // 2:, s],
                                                                      v[:, H // 2:, s]), rtol=1e-5, atol=1e-6)
    # the wrapped group of the shifted half holds the first G/2 positions: causal over those alone
    s = slice(0, G // 2)
    torch.testing.assert_close(out[:, H // 2:, s].double(), causal(q[:, H // 2:, s], k[:, H // 2:, s],
                                                                  v[:, H // 2:, s]), rtol=1e-5, atol=1e-6)


def test_the_shift_connects_neighbouring_groups_and_nothing_sees_the_future():
    G, T, H = 8, 32, 4
    q, k, v = qkv(B=1, H=H, T=T)
    v.requires_grad_(True)
    out = shifted_sparse_attention(q, k, v, G)
    grad = lambda head, pos: torch.autograd.grad(out[0, head, pos].sum(), v, retain_graph=True)[0][0, head]  # noqa: E731
    first_of_group_1 = G
    # unshifted heads: position G sees group 1 only; shifted heads: it also sees the second half of group 0
    assert grad(0, first_of_group_1)[: G].abs().sum() == 0
    reach = grad(H - 1, first_of_group_1).abs().sum(-1)
    assert (reach[G // 2: G] > 0).all() and (reach[: G // 2] == 0).all() and (reach[G + 1:] == 0).all()
    for pos in range(T):  # causal in every head, the wrapped group included
        for head in (0, H - 1):
            assert grad(head, pos)[pos + 1:].abs().sum() == 0


def test_bad_group_sizes_say_what_to_do():
    q, k, v = qkv(T=24)
    with pytest.raises(ConfigError, match="multiple of 10"):
        shifted_sparse_attention(q, k, v, 10)
    with pytest.raises(ConfigError, match="even number"):
        shifted_sparse_attention(q, k, v, 3)


def test_a_model_uses_s2_attention_only_while_training_inside_the_block():
    cfg = get_preset("tiny", vocab_size=97, max_seq_len=64, position="rope", dropout=0.0, attention_dropout=0.0)
    torch.manual_seed(0)
    model = build_model(cfg)
    ids = torch.randint(0, 97, (2, 32))
    full = model.eval()(ids).logits
    model.train()
    with shifted_attention(model, 8):
        sparse = model(ids).logits
        torch.testing.assert_close(model.eval()(ids).logits, full, rtol=1e-5, atol=1e-5)  # eval: full attention
        model.train()
    # positions 0..G/2-1 see the same keys either way; later ones lose what lies outside their groups
    torch.testing.assert_close(sparse[:, :4], full[:, :4], rtol=1e-5, atol=1e-5)
    assert (sparse[:, 8:] - full[:, 8:]).abs().max() > 1e-3
    torch.testing.assert_close(model(ids).logits, full, rtol=1e-5, atol=1e-5)  # after the block: full attention
