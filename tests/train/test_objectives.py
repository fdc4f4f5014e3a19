"""Next-token loss: the shift, padding left out of sum and count, perplexity and bits per byte."""
import math

import pytest
import torch

from lmkit.objectives import IGNORE_INDEX, bits_per_byte, next_token_loss, next_token_targets, perplexity


def test_targets_are_inputs_shifted_by_one():
    rows = torch.tensor([[7, 1, 2, 3, 4], [7, 5, 6, 0, 0]])
    mask = torch.tensor([[1, 1, 1, 1, 1], [1, 1, 1, 0, 0]])
    inputs, targets = next_token_targets(rows, mask)
    assert inputs.tolist() == [[7, 1, 2, 3], [7, 5, 6, 0]]
    assert targets.tolist() == [[1, 2, 3, 4], [5, 6, IGNORE_INDEX, IGNORE_INDEX]]


def test_padding_changes_neither_sum_nor_count():
    torch.manual_seed(0)
    V = 11
    logits = torch.randn(2, 5, V)
    targets = torch.randint(V, (2, 5))
    base = next_token_loss(logits, targets)
    # append 3 padded positions with arbitrary (even huge) logits
    pad_logits = torch.cat([logits, 1e4 * torch.randn(2, 3, V)], dim=1)
    pad_targets = torch.cat([targets, torch.full((2, 3), IGNORE_INDEX)], dim=1)
    padded = next_token_loss(pad_logits, pad_targets)
    assert padded.count.item() == base.count.item() == 10
    torch.testing.assert_close(padded.sum, base.sum, rtol=0, atol=1e-5)
    # padding a whole extra row also changes nothing
    row = next_token_loss(torch.cat([logits, torch.randn(1, 5, V)]), torch.cat([targets, torch.full((1, 5), IGNORE_INDEX)]))
    assert row.count.item() == 10
    torch.testing.assert_close(row.sum, base.sum, rtol=0, atol=1e-5)


def test_sum_is_negative_log_likelihood_of_each_target():
    torch.manual_seed(1)
    logits = torch.randn(1, 4, 6)
    targets = torch.tensor([[2, 0, IGNORE_INDEX, 5]])
    logp = torch.log_softmax(logits, -1)[0]
    expected = -(logp[0, 2] + logp[1, 0] + logp[3, 5])
    out = next_token_loss(logits, targets)
    torch.testing.assert_close(out.sum, expected)
    assert out.count.item() == 3
    torch.testing.assert_close(out.mean, expected / 3)


def test_matches_transformers_causal_lm_loss():
    from transformers.loss.loss_utils import ForCausalLMLoss

    torch.manual_seed(2)
    V = 13
    rows = torch.randint(V, (3, 9))
    mask = torch.ones_like(rows)
    mask[1, 6:] = 0
    mask[2, 4:] = 0
    logits = torch.randn(3, 9, V)
    labels = rows.masked_fill(mask == 0, IGNORE_INDEX)
    reference = ForCausalLMLoss(logits, labels, vocab_size=V)
    _, targets = next_token_targets(rows, mask)
    mine = next_token_loss(logits[:, :-1], targets)
    torch.testing.assert_close(mine.mean, reference)


@pytest.mark.bf16
def test_bf16_logits_are_scored_in_float32():
    torch.manual_seed(3)
    logits = torch.randn(2, 7, 50).bfloat16()
    targets = torch.randint(50, (2, 7))
    out = next_token_loss(logits, targets)
    assert out.sum.dtype == torch.float32
    torch.testing.assert_close(out.sum, next_token_loss(logits.float(), targets).sum)


def test_uniform_model_has_perplexity_v_and_eight_bits_per_byte():
    V = 256
    logits = torch.zeros(1, 100, V)
    targets = torch.randint(V, (1, 100))
    out = next_token_loss(logits, targets)
    assert perplexity(out.mean.item()) == pytest.approx(V)
    # one byte per token: a uniform guess over 256 bytes costs exactly 8 bits per byte
    assert bits_per_byte(out.sum.item(), 100) == pytest.approx(8.0)
    # the same nats spread over twice the bytes: half the bits per byte
    assert bits_per_byte(out.sum.item(), 200) == pytest.approx(4.0)


def test_bits_per_byte_needs_bytes_and_perplexity_overflow():
    with pytest.raises(ValueError):
        bits_per_byte(1.0, 0)
    assert perplexity(1e6) == math.inf
    assert bits_per_byte(math.log(2) * 12, 3) == pytest.approx(4.0)
