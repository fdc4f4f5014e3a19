"""CausalLM: presets, the next-token loss, padding, and incremental decoding equal to full recomputation."""
import pytest
import torch

import lmkit
from lmkit.config import PRESETS, ModelConfig, get_preset
from lmkit.errors import ConfigError, GenerationError
from lmkit.models import CausalLM, build_model
from lmkit.nn import KVCache



SMALL = dict(vocab_size=53, d_model=24, n_layers=2, n_heads=4, max_seq_len=40)
VARIANTS = {
    "gpt2": dict(get_preset("gpt2").to_dict(), **SMALL),
    "llama": dict(get_preset("llama").to_dict(), **SMALL, n_kv_heads=2),
    "transformer-2017": dict(get_preset("transformer-2017").to_dict(), **SMALL, d_ff=40, dropout=0.0),
    "sandwich-mqa": dict(get_preset("llama").to_dict(), **SMALL, n_kv_heads=1, norm_placement="sandwich"),
    "peri-gpt2": dict(get_preset("gpt2").to_dict(), **SMALL, norm_placement="peri"),
}


def model(name: str) -> CausalLM:
    torch.manual_seed(0)
    m = CausalLM(ModelConfig(**VARIANTS[name]))
    for p in m.parameters():  # bigger weights than init so that mistakes show in the logits
        torch.nn.init.normal_(p, std=0.2) if p.dim() > 1 else torch.nn.init.normal_(p, 1.0, 0.1)
    return m.eval()


def test_presets():
    gpt2, llama, t2017 = get_preset("gpt2"), get_preset("llama"), get_preset("transformer-2017")
    assert (gpt2.position, gpt2.norm, gpt2.activation, gpt2.norm_placement, gpt2.tie_embeddings) == \
        ("learned", "layernorm", "gelu_tanh", "pre", True)
    assert (llama.position, llama.norm, llama.activation, llama.tie_embeddings) == ("rope", "rmsnorm", "swiglu", False)
    assert llama.resolved_n_kv_heads < llama.n_heads
    assert (t2017.norm_placement, t2017.position, t2017.activation) == ("post", "sinusoidal", "relu")
    assert {"tiny", "default"} <= set(PRESETS)
    tiny = build_model(get_preset("tiny"))
    assert isinstance(tiny, CausalLM) and tiny.num_parameters() < 1_000_000 and tiny.config.dropout == 0
    assert get_preset("gpt2", n_layers=3).n_layers == 3
    with pytest.raises(ConfigError, match="choose one of"):
        get_preset("gpt5")
    with pytest.raises(ConfigError):
        ModelConfig(norm_placement="middle")
    assert lmkit.CausalLM is CausalLM


def test_default_preset_builds_and_runs():
    m = build_model(get_preset("default", n_layers=1, d_model=32, n_heads=4, n_kv_heads=2, vocab_size=64))
    out = m(torch.randint(0, 64, (2, 5)))
    assert out.logits.shape == (2, 5, 64)


@pytest.mark.parametrize("name", list(VARIANTS))
def test_loss_is_mean_next_token_cross_entropy(name):
    m = model(name)
    ids = torch.randint(0, 53, (2, 7))
    out = m(ids, labels=ids)
    logp = out.logits.log_softmax(-1)
    expected = -logp[:, :-1].gather(-1, ids[:, 1:, None]).mean()
    torch.testing.assert_close(out.loss, expected)
    labels = ids.clone()
    labels[0, 3:] = -100  # ignored positions count neither in the sum nor in the mean
    kept = labels[:, 1:] != -100
    nll = -logp[:, :-1].gather(-1, ids[:, 1:, None])[..., 0]
    torch.testing.assert_close(m(ids, labels=labels).loss, nll[kept].mean())


@pytest.mark.parametrize("name", list(VARIANTS))
def test_logits_at_t_ignore_later_tokens(name):
    m = model(name)
    ids = torch.randint(0, 53, (1, 10))
    other = ids.clone()
    other[:, 6:] = (other[:, 6:] + 1) % 53
    torch.testing.assert_close(m(ids).logits[:, :6], m(other).logits[:, :6])


@pytest.mark.parametrize("name", list(VARIANTS))
def test_incremental_decoding_with_the_cache_equals_full_recomputation(name):
    m = model(name)
    ids = torch.randint(0, 53, (2, 12))
    full = m(ids).logits
    cache = KVCache()
    steps = [m(ids[:, :5], past_key_values=cache, use_cache=True).logits]
    for t in range(5, 12):
        out = m(ids[:, t:t + 1], past_key_values=cache, use_cache=True)
        assert out.past_key_values is cache
        steps.append(out.logits)
    torch.testing.assert_close(torch.cat(steps, 1), full, atol=1e-4, rtol=1e-4)


@pytest.mark.parametrize("name", ["gpt2", "llama"])
def test_padded_rows_equal_rows_alone(name):
    m = model(name)
    a, b = torch.randint(0, 53, (1, 8)), torch.randint(0, 53, (1, 5))
    # right padding: real tokens keep positions 0..4
    right = torch.cat([b, torch.zeros(1, 3, dtype=torch.long)], 1)
    mask = torch.tensor([[1] * 5 + [0] * 3])
    torch.testing.assert_close(m(right, attention_mask=mask).logits[:, :5], m(b).logits, atol=1e-5, rtol=1e-5)
    # left padding with positions counted from the first real token, batched with a full row
    left = torch.cat([a, torch.cat([torch.zeros(1, 3, dtype=torch.long), b], 1)])
    mask = torch.tensor([[1] * 8, [0] * 3 + [1] * 5])
    pos = (mask.cumsum(-1) - 1).clamp(min=0)
    out = m(left, attention_mask=mask, position_ids=pos).logits
    torch.testing.assert_close(out[0], m(a).logits[0], atol=1e-5, rtol=1e-5)
    torch.testing.assert_close(out[1, 3:], m(b).logits[0], atol=1e-5, rtol=1e-5)


def test_logits_to_keep_and_inputs_embeds():
    m = model("llama")
    ids = torch.randint(0, 53, (2, 6))
    full = m(ids).logits
    torch.testing.assert_close(m(ids, logits_to_keep=1).logits, full[:, -1:])
    keep = torch.tensor([4, 0, 2])  # a tensor lists the positions, as in transformers
    torch.testing.assert_close(m(ids, logits_to_keep=keep).logits, full[:, keep])
    embeds = m.get_input_embeddings()(ids)
    torch.testing.assert_close(m(inputs_embeds=embeds).logits, full)


@pytest.mark.parametrize("name", list(VARIANTS) + ["llama-window3"])
def test_the_last_block_run_at_the_kept_positions_alone_gives_the_full_forwards_rows(name):
    """With logits_to_keep the last block attends and runs its FFN at the kept positions only; their logits and
    every position's cached keys and values are those of the full forward: after a cached past, with left
    padding, with a sliding window, for the last position and for positions listed in any order."""
    config = dict(VARIANTS["llama"], sliding_window=3) if name == "llama-window3" else VARIANTS[name]
    torch.manual_seed(0)
    m = CausalLM(ModelConfig(**config))
    for p in m.parameters():
        torch.nn.init.normal_(p, std=0.2) if p.dim() > 1 else torch.nn.init.normal_(p, 1.0, 0.1)
    m.eval()
    seen = []
    ffn = m.decoder.layers[-1].mlp.sublayer
    ffn.forward = lambda x, f=ffn.forward: seen.append(x.shape[1]) or f(x)  # not a hook: hooks turn pruning off
    ids = torch.randint(0, 53, (2, 9))
    mask = torch.ones(2, 9, dtype=torch.long)
    mask[1, :3] = 0
    pos = (mask.cumsum(-1) - 1).clamp(min=0)
    for kw in (dict(), dict(attention_mask=mask, position_ids=pos)):
        full = m(ids, **kw).logits
        for keep in (1, 4, torch.tensor([6, 0, 8, 3]), torch.tensor([-1, 2])):
            seen.clear()
            got = m(ids, logits_to_keep=keep, **kw).logits
            rows = full[:, -keep:] if isinstance(keep, int) else full[:, keep]
            torch.testing.assert_close(got, rows, atol=1e-5, rtol=1e-5)
            assert seen == [rows.shape[1]]  # the last FFN ran at the kept positions only
    # after a cached past: the kept logits and the cache both as without logits_to_keep
    whole, part = KVCache(), KVCache()
    m(ids[:, :5], past_key_values=whole, use_cache=True)
    m(ids[:, :5], past_key_values=part, use_cache=True)
    full = m(ids[:, 5:], past_key_values=whole, use_cache=True).logits
    got = m(ids[:, 5:], past_key_values=part, use_cache=True, logits_to_keep=torch.tensor([0, 2])).logits
    torch.testing.assert_close(got, full[:, [0, 2]], atol=1e-5, rtol=1e-5)
    for layer in whole.keys:
        torch.testing.assert_close(part.keys[layer][:, :, :9], whole.keys[layer][:, :, :9])
        torch.testing.assert_close(part.values[layer][:, :, :9], whole.values[layer][:, :, :9])


def test_input_longer_than_learned_positions_raises():
    m = model("gpt2")
    with pytest.raises(GenerationError, match="positions"):
        m(torch.zeros(1, 41, dtype=torch.long))


def test_training_step_lowers_the_loss():
    torch.manual_seed(0)
    m = CausalLM(ModelConfig(**VARIANTS["llama"])).train()
    ids = torch.randint(0, 53, (4, 16))
    opt = torch.optim.AdamW(m.parameters(), lr=1e-2)
    first = None
    for _ in range(5):
        loss = m(ids, labels=ids).loss
        first = first if first is not None else loss.item()
        loss.backward()
        opt.step()
        opt.zero_grad()
    assert m(ids, labels=ids).loss.item() < first
