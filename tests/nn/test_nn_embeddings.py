"""Token embeddings, weight tying and the three position schemes (learned, sinusoidal, RoPE): their math."""
import math

import pytest
import torch

from lmkit.config import ModelConfig, get_preset
from lmkit.errors import ConfigError, GenerationError, SequenceTooLongError
from lmkit.models import CausalLM
from lmkit.nn import Embeddings, RotaryEmbedding, apply_rotary, sinusoidal_table
from lmkit.nn.positions import rope_inverse_frequencies




def cfg(**kw) -> ModelConfig:
    base = dict(vocab_size=37, d_model=12, n_layers=1, n_heads=3, max_seq_len=20, position="none")
    return ModelConfig(**{**base, **kw})


def test_lookup_equals_one_hot_times_embedding_matrix():
    torch.manual_seed(0)
    emb = Embeddings(cfg())
    ids = torch.tensor([[0, 5, 36, 5], [1, 2, 3, 4]])
    one_hot = torch.nn.functional.one_hot(ids, 37).float()
    torch.testing.assert_close(emb(ids), one_hot @ emb.tokens.weight, rtol=0, atol=1e-6)


def test_embedding_scale_multiplies_the_lookup():
    torch.manual_seed(0)
    emb = Embeddings(cfg(embedding_scale=math.sqrt(12)))
    ids = torch.tensor([[3, 1]])
    torch.testing.assert_close(emb(ids), emb.tokens.weight[ids] * math.sqrt(12))


def test_tied_lm_head_is_the_embedding_matrix_and_learns_from_both_uses():
    torch.manual_seed(0)
    model = CausalLM(cfg(tie_embeddings=True, position="learned"))
    assert model.lm_head.weight is model.decoder.embeddings.tokens.weight
    ids = torch.tensor([[1, 2, 3]])
    h = model.decoder(ids)
    torch.testing.assert_close(model(ids).logits, h @ model.decoder.embeddings.tokens.weight.T)
    # a token that never appears in the input still gets a gradient through the output projection
    model(ids, labels=ids).loss.backward()
    assert model.decoder.embeddings.tokens.weight.grad[30].abs().sum() > 0
    untied = CausalLM(cfg(tie_embeddings=False))
    assert untied.lm_head.weight is not untied.decoder.embeddings.tokens.weight
    assert untied.num_parameters() == model.num_parameters() - model.decoder.embeddings.positions.weight.numel() \
        + untied.lm_head.weight.numel()


def test_learned_positions_add_row_i_of_the_position_table():
    torch.manual_seed(0)
    emb = Embeddings(cfg(position="learned", position_offset=2))
    ids = torch.tensor([[4, 4, 4]])
    out = emb(ids)
    # the same token at three positions differs by exactly the position rows 2, 3, 4 (offset 2)
    torch.testing.assert_close(out[0] - emb.tokens.weight[4], emb.positions.weight[2:5])
    shifted = emb(ids, position_ids=torch.tensor([[5, 6, 7]]))
    torch.testing.assert_close(shifted[0] - emb.tokens.weight[4], emb.positions.weight[7:10])


@pytest.mark.parametrize("base", [10000.0, 500.0])
def test_sinusoidal_table_formula(base):
    d, n = 10, 7
    table = sinusoidal_table(n, d, base)
    for pos in range(n):
        for i in range(d // 2):
            angle = pos / base ** (2 * i / d)
            assert table[pos, 2 * i].item() == pytest.approx(math.sin(angle), abs=1e-6)
            assert table[pos, 2 * i + 1].item() == pytest.approx(math.cos(angle), abs=1e-6)


def test_sinusoidal_base_defaults_to_10000_and_reaches_the_embeddings():
    assert ModelConfig().sinusoidal_base == 10000.0
    emb = Embeddings(cfg(position="sinusoidal", sinusoidal_base=100.0))
    zero = torch.zeros_like(emb.tokens.weight)
    emb.tokens.weight.data.copy_(zero)
    out = emb(torch.zeros(1, 5, dtype=torch.long))
    torch.testing.assert_close(out[0], sinusoidal_table(5, 12, 100.0))


def test_sinusoidal_relative_shift_is_a_rotation():
    """PE[p + k] is a fixed linear map (rotation per frequency pair) of PE[p], the same for every p."""
    table = sinusoidal_table(30, 8).double()
    k = 3
    a, b = table[:20], table[k:20 + k]
    rot = torch.linalg.lstsq(a, b).solution
    torch.testing.assert_close(a @ rot, b, atol=1e-5, rtol=0)


def test_positions_beyond_the_table_raise_a_clear_error():
    emb = Embeddings(cfg(position="learned"))
    with pytest.raises(SequenceTooLongError, match="positions") as err:
        emb(torch.zeros(1, 21, dtype=torch.long))
    assert isinstance(err.value, GenerationError)  # still caught where generation errors are
    # the message fits training as well as generation: it names the limit and what to shorten
    assert "at most 20 tokens per row" in str(err.value) and "--max-length" in str(err.value)


# --- RoPE --------------------------------------------------------------------------------------

def rope(config: ModelConfig, positions: list[int]):
    return RotaryEmbedding(config)(torch.tensor([positions]), torch.float32)


@pytest.mark.parametrize("interleaved", [False, True])
@pytest.mark.parametrize("scaling", [None, {"type": "linear", "factor": 4.0}, {"type": "ntk", "factor": 2.0}])
def test_rope_scores_depend_only_on_the_offset(interleaved, scaling):
    torch.manual_seed(0)
    c = cfg(position="rope", d_model=16, n_heads=2, rope_interleaved=interleaved, rope_scaling=scaling)
    q, k = torch.randn(1, 1, 1, 8), torch.randn(1, 1, 1, 8)

    def score(m: int, n: int) -> float:
        cos, sin = rope(c, [m, n])
        rq = apply_rotary(q, cos[:, :1], sin[:, :1], interleaved)
        rk = apply_rotary(k, cos[:, 1:], sin[:, 1:], interleaved)
        return (rq * rk).sum().item()

    for offset in (0, 1, 5):
        scores = [score(m + offset, m) for m in (0, 3, 11, 40)]
        assert max(scores) - min(scores) < 1e-4, scores
    assert abs(score(5, 0) - score(6, 0)) > 1e-4  # and it does depend on the offset


def test_rope_rotation_keeps_the_norm_and_position_zero_is_identity():
    torch.manual_seed(0)
    c = cfg(position="rope", d_model=16, n_heads=2)
    x = torch.randn(2, 2, 5, 8)
    cos, sin = RotaryEmbedding(c)(torch.arange(5)[None].expand(2, 5), torch.float32)
    y = apply_rotary(x, cos, sin)
    torch.testing.assert_close(y.norm(dim=-1), x.norm(dim=-1))
    torch.testing.assert_close(y[:, :, 0], x[:, :, 0])


def test_rope_angles_follow_theta_and_the_scalings():
    d = 8
    for theta in (10000.0, 500000.0):
        expected = torch.tensor([theta ** (-2 * m / d) for m in range(d // 2)])
        torch.testing.assert_close(rope_inverse_frequencies(d, theta), expected)
    base = rope_inverse_frequencies(d, 10000.0)
    # linear (position interpolation): position p behaves as p / factor
    torch.testing.assert_close(rope_inverse_frequencies(d, 10000.0, {"type": "linear", "factor": 4.0}), base / 4)
    # NTK-aware: theta' = theta * factor^(d / (d - 2)); the highest frequency is unchanged, the lowest divided by factor
    ntk = rope_inverse_frequencies(d, 10000.0, {"type": "ntk", "factor": 4.0})
    torch.testing.assert_close(ntk, rope_inverse_frequencies(d, 10000.0 * 4.0 ** (d / (d - 2))))
    assert ntk[0] == base[0]
    torch.testing.assert_close(ntk[-1], base[-1] / 4)
    with pytest.raises(ConfigError):
        rope_inverse_frequencies(d, 10000.0, {"type": "yarn-but-wrong", "factor": 2.0})


def test_rope_pair_layouts_agree_up_to_a_feature_permutation():
    """Interleaved pairs (2m, 2m+1) and HF halves (m, m + d/2) are the same rotation on permuted features."""
    torch.manual_seed(0)
    d = 8
    perm = torch.tensor([0, 2, 4, 6, 1, 3, 5, 7])  # interleaved index order -> halves
    x = torch.randn(1, 1, 4, d)
    pos = torch.arange(4)[None]
    halves = RotaryEmbedding(cfg(position="rope", d_model=16, n_heads=2))(pos, torch.float32)
    inter = RotaryEmbedding(cfg(position="rope", d_model=16, n_heads=2, rope_interleaved=True))(pos, torch.float32)
    y_inter = apply_rotary(x, *inter, interleaved=True)
    y_halves = apply_rotary(x[..., perm], *halves, interleaved=False)
    torch.testing.assert_close(y_inter[..., perm], y_halves)


def test_rope_needs_an_even_head_dimension():
    with pytest.raises(ConfigError, match="even"):
        cfg(position="rope", d_model=15, n_heads=3)


def test_presets_choose_their_positions():
    assert get_preset("gpt2").position == "learned"
    assert get_preset("llama").position == "rope"
    assert get_preset("transformer-2017").position == "sinusoidal"
