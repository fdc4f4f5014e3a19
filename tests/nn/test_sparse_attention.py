"""Longformer's sliding-window + global attention (`lmkit.nn.sparse_attention`) against its definition written as
a dense n x n mask in float64: values and gradients, odd lengths, windows wider than the sequence, padding and
global tokens anywhere."""
from __future__ import annotations

import pytest
import torch

from lmkit.errors import ConfigError
from lmkit.nn.sparse_attention import sliding_global_attention, token_mask
from helpers.sparse_attention import longformer_case, longformer_reference as dense_reference


@pytest.mark.parametrize("T,w", [(23, 2), (16, 4), (5, 8), (1, 3), (37, 5)])
def test_sliding_global_attention_equals_the_dense_masked_formula(T, w):
    q, k, v, m, g = longformer_case(T, w)
    got = sliding_global_attention(q, k, v, m, w)
    want = dense_reference(q, k, v, m.keep, m.glob, w)
    torch.testing.assert_close(got, want, atol=1e-12, rtol=0)
    weights = torch.randn(got.shape, generator=g, dtype=torch.float64)
    grads = torch.autograd.grad((got * weights).sum(), (q, k, v))
    expected = torch.autograd.grad((want * weights).sum(), (q, k, v))
    for a, b in zip(grads, expected):
        torch.testing.assert_close(a, b, atol=1e-12, rtol=0)


def test_a_mask_not_shaped_like_the_input_is_refused():
    with pytest.raises(ConfigError, match=r"attention_mask has shape \(2, 6\).*shaped like input_ids"):
        token_mask(torch.ones(2, 6), None, 2, 7, torch.device("cpu"))


def test_pruning_a_longformer_head_equals_gating_it_off_and_the_pruned_folder_loads_back(tmp_path):
    """Head pruning slices the global projections with q/k/v/o: a pruned model with global tokens gives what the
    full model gives with that head's output gated to zero, and reloads from its folder with the same outputs."""
    import lmkit
    from lmkit.compress.prune import attention_modules, head_gates, prune_heads
    from lmkit.config import get_preset
    from lmkit.models import build_model

    torch.manual_seed(0)
    model = build_model(get_preset("longformer-tiny", vocab_size=90, n_heads=4, max_seq_len=80,
                                   sparse={"sparse_attention": "longformer", "attention_window": [8, 4]})).eval()
    ids = torch.randint(3, 90, (2, 37))
    glob = torch.zeros_like(ids)
    glob[:, [0, 20]] = 1
    name = next(iter(attention_modules(model)))
    with torch.no_grad(), head_gates(model) as gates:
        gates[name].data[1] = 0.0
        want = model(ids, global_attention_mask=glob).logits
    prune_heads(model, {name: [1]})
    with torch.no_grad():
        got = model(ids, global_attention_mask=glob).logits
    torch.testing.assert_close(got, want, atol=1e-5, rtol=0)
    model.save_pretrained(tmp_path)
    with torch.no_grad():
        again = lmkit.load_model(tmp_path)(ids, global_attention_mask=glob).logits
    torch.testing.assert_close(again, got, atol=0, rtol=0)


def test_attention_maps_of_a_sparse_model_are_refused_in_one_line():
    from lmkit.config import get_preset
    from lmkit.lens.attention import attention_maps
    from lmkit.models import build_model

    model = build_model(get_preset("longformer-tiny", vocab_size=90, max_seq_len=80)).eval()
    with pytest.raises(ConfigError, match="not kept by sparse attention"):
        attention_maps(model, torch.randint(3, 90, (1, 30)))
