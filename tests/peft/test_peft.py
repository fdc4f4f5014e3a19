"""Parameter-efficient fine-tuning on every family: LoRA, QLoRA, prefix, prompt, adapters, IA3."""
import pytest
import torch

from lmkit.config import ModelConfig
from lmkit.errors import CheckpointError, ConfigError
from lmkit.models import build_model
from lmkit.peft import LoRALinear, QuantizedLinear, format_summary, get_peft_model, load_adapter, trainable_summary
from lmkit.peft.quant import nf4_levels


COMMON = dict(vocab_size=53, d_model=32, n_layers=2, n_heads=4, max_seq_len=32, dropout=0.0, attention_dropout=0.0)
FAMILIES = {
    "gpt2": dict(COMMON, family="gpt2", activation="gelu_tanh"),
    "llama": dict(COMMON, family="llama", position="rope", norm="rmsnorm", activation="swiglu", bias=False,
                  n_kv_heads=2, tie_embeddings=False),
    "encoder": dict(COMMON, architecture="encoder", norm_placement="post", embedding_norm=True, type_vocab_size=2,
                    extra={"head": "mlm"}),
    "seq2seq": dict(COMMON, architecture="encoder-decoder", position="relative", norm="rmsnorm", bias=False,
                    decoder_start_token_id=0, pad_token_id=0),
}


def make(family: str, seed: int = 0):
    torch.manual_seed(seed)
    try:
        model = build_model(ModelConfig(**FAMILIES[family]))
    except ModuleNotFoundError:
        pytest.skip(f"the {family} family is not built yet")
    return model.eval()


def run(model, ids, mask=None):
    kw = {"attention_mask": mask}
    if model.config.architecture == "encoder-decoder":
        kw["decoder_input_ids"] = ids[:, :5]
    out = model(ids, **kw)
    return out.logits


def perturb(model):
    g = torch.Generator().manual_seed(7)
    with torch.no_grad():
        for p in model.parameters():
            if p.requires_grad:
                p.add_(torch.randn(p.shape, generator=g) * 0.3)


IDS = torch.randint(1, 53, (2, 9), generator=torch.Generator().manual_seed(1))
MASK = torch.tensor([[1] * 9, [0, 0] + [1] * 7])


@pytest.mark.parametrize("family", list(FAMILIES))
@pytest.mark.parametrize("method", ["lora", "qlora", "prefix", "prompt", "adapter", "ia3"])
def test_every_method_on_every_family(family, method):
    model = make(family)
    with torch.no_grad():
        before = run(model, IDS)
    base_params = {n: p.detach().clone() for n, p in model.named_parameters()}
    peft = get_peft_model(model, method, r=4, bits=8, num_virtual_tokens=3, bottleneck=4)
    with torch.no_grad():
        start = run(peft, IDS)
    if method in ("lora", "adapter", "ia3"):  # these start exactly at the base model
        torch.testing.assert_close(start, before, rtol=0, atol=1e-6)
    elif method == "qlora":  # int8 blocks: close to the base
        assert (start - before).abs().max() < 0.05
    out = run(peft, IDS, MASK)
    out.float().pow(2).mean().backward()
    trainable = [n for n, p in peft.named_parameters() if p.requires_grad]
    assert trainable and all(p.grad is not None for p in peft.parameters() if p.requires_grad)
    frozen_grads = [n for n, p in peft.named_parameters() if not p.requires_grad and p.grad is not None]
    assert not frozen_grads
    s = trainable_summary(peft)
    assert 0 < s["trainable"] < 0.5 * s["total"]
    perturb(peft)
    with torch.no_grad():
        assert not torch.allclose(run(peft, IDS), start)
    # the base weights never moved
    now = dict(peft.base_model.named_parameters())
    for n, p in base_params.items():
        if n in now:
            torch.testing.assert_close(now[n], p, rtol=0, atol=0)


def test_lora_update_is_alpha_over_r_BA():
    layer = torch.nn.Linear(6, 5)
    lora = LoRALinear(layer, r=3, alpha=12.0)
    with torch.no_grad():
        lora.lora_B.weight.normal_()
    x = torch.randn(4, 6)
    want = layer(x) + 4.0 * x @ lora.lora_A.weight.t() @ lora.lora_B.weight.t()
    torch.testing.assert_close(lora(x), want)


@pytest.mark.parametrize("family", ["gpt2", "llama", "encoder"])
def test_lora_merge_unmerge(family):
    model = make(family)
    peft = get_peft_model(model, "lora", r=4, alpha=8, target_modules=["q_proj", "v_proj", "up_proj", "down_proj"])
    perturb(peft)
    with torch.no_grad():
        unmerged = run(peft, IDS, MASK)
        peft.merge()
        merged = run(peft, IDS, MASK)
        torch.testing.assert_close(merged, unmerged, rtol=0, atol=1e-5)
        peft.unmerge()
        torch.testing.assert_close(run(peft, IDS, MASK), unmerged, rtol=0, atol=1e-5)
        plain = peft.merge_and_unload()
        assert not any(isinstance(m, LoRALinear) for m in plain.modules())
        torch.testing.assert_close(run(plain, IDS, MASK), unmerged, rtol=0, atol=1e-5)


def test_lora_targets_by_pattern_and_summary():
    model = make("llama")
    peft = get_peft_model(model, "lora", r=2, target_modules=["re:.*layers\\.1\\..*q_proj"])
    assert peft.targets == ["decoder.layers.1.self_attn.sublayer.q_proj"]
    s = peft.trainable_summary()
    assert s["trainable"] == 2 * (32 + 32)
    assert abs(s["percent"] - 100 * s["trainable"] / s["total"]) < 1e-9
    assert format_summary(s) == f"trainable params: 128 || all params: {s['total']:,} || trainable%: {s['percent']:.4f}"
    with pytest.raises(ConfigError, match="target_modules"):
        get_peft_model(make("llama"), "lora", target_modules=["nothing_here"])


@pytest.mark.parametrize("method", ["lora", "qlora", "prefix", "prompt", "adapter", "ia3"])
def test_adapter_save_and_load(tmp_path, method):
    peft = get_peft_model(make("llama"), method, r=4, num_virtual_tokens=3)
    perturb(peft)
    with torch.no_grad():
        want = run(peft, IDS, MASK)
    peft.save_adapter(tmp_path)
    assert {p.name for p in tmp_path.iterdir()} == {"adapter_config.json", "adapter_model.safetensors"}
    loaded = load_adapter(make("llama"), tmp_path)
    with torch.no_grad():
        torch.testing.assert_close(run(loaded, IDS, MASK), want, rtol=1e-5, atol=1e-5)


def test_quantized_linear_error_bounds():
    torch.manual_seed(0)
    linear = torch.nn.Linear(100, 30)  # 3000 weights: the last block is partial
    w = linear.weight.detach()
    q8, q4 = QuantizedLinear(linear, bits=8, block_size=64), QuantizedLinear(linear, bits=4, block_size=64)
    blocks = torch.nn.functional.pad(w.reshape(-1), (0, -w.numel() % 64)).view(-1, 64)
    bound8 = (blocks.abs().amax(1, keepdim=True) / 127 / 2).expand(-1, 64).reshape(-1)[: w.numel()].view_as(w)
    assert ((q8.dequantize() - w).abs() <= bound8 + 1e-7).all()
    levels = nf4_levels()
    assert len(levels) == 16 and levels.min() == -1 and levels.max() == 1 and (levels == 0).any()
    gap = (levels[1:] - levels[:-1]).max() / 2
    bound4 = (blocks.abs().amax(1, keepdim=True) * gap).expand(-1, 64).reshape(-1)[: w.numel()].view_as(w)
    assert ((q4.dequantize() - w).abs() <= bound4 + 1e-7).all()
    assert q4.storage_bytes() < q8.storage_bytes() < w.numel() * 4 / 3
    x = torch.randn(5, 100)
    torch.testing.assert_close(q8(x), x @ q8.dequantize().t() + linear.bias)


def test_qlora_merge_gives_full_precision_layers():
    peft = get_peft_model(make("llama"), "qlora", bits=4, r=4)
    assert any(isinstance(m, QuantizedLinear) for m in peft.modules())
    perturb(peft)
    with torch.no_grad():
        want = run(peft, IDS)
        with pytest.raises(ConfigError):
            peft.merge()
        plain = peft.merge_and_unload()
        torch.testing.assert_close(run(plain, IDS), want, rtol=0, atol=1e-5)


def test_prefix_attention_is_attention_over_prefix_and_sequence():
    """softmax(q [K_p; K]^T / sqrt(d)) [V_p; V] per head, every query seeing the whole prefix."""
    from lmkit.nn.attention import Attention
    from lmkit.peft.prompt import PrefixAttention

    torch.manual_seed(0)
    cfg = ModelConfig(**FAMILIES["gpt2"])
    attn = Attention(cfg, causal=True)
    pre = PrefixAttention(attn, 3, std=1.0)
    x = torch.randn(2, 5, 32)
    got = pre(x, is_causal=True)
    H, D, P, T = 4, 8, 3, 5
    q = attn.q_proj(x).view(2, T, H, D).transpose(1, 2)
    k = torch.cat([pre.prefix_keys.expand(2, -1, -1, -1), attn.k_proj(x).view(2, T, H, D).transpose(1, 2)], 2)
    v = torch.cat([pre.prefix_values.expand(2, -1, -1, -1), attn.v_proj(x).view(2, T, H, D).transpose(1, 2)], 2)
    scores = q @ k.transpose(-1, -2) / D ** 0.5
    allowed = torch.arange(P + T)[None, :] <= torch.arange(T)[:, None] + P
    scores = scores.masked_fill(~allowed, float("-inf"))
    want = attn.o_proj((scores.softmax(-1) @ v).transpose(1, 2).reshape(2, T, H * D))
    torch.testing.assert_close(got, want, rtol=1e-5, atol=1e-5)


@pytest.mark.parametrize("method", ["prefix", "prompt", "lora"])
def test_generation_with_cache_matches_full_forward(method):
    peft = get_peft_model(make("llama"), method, num_virtual_tokens=4)
    perturb(peft)
    prompt = IDS[:1, :6]
    out = peft.generate(prompt, max_new_tokens=5, do_sample=False)
    assert out.shape == (1, 11) and torch.equal(out[:, :6], prompt)
    seq = prompt
    with torch.no_grad():
        for _ in range(5):  # greedy without a cache, one full forward per token
            nxt = peft(seq).logits[:, -1].argmax(-1, keepdim=True)
            seq = torch.cat([seq, nxt], 1)
    assert torch.equal(out, seq)


def test_prompt_tuning_is_prompt_embeddings_in_front():
    model = make("llama")
    peft = get_peft_model(model, "prompt", num_virtual_tokens=3)
    perturb(peft)
    emb = model.decoder.embeddings.tokens
    with torch.no_grad():
        inputs = torch.cat([emb.prompt_embeddings[None].expand(2, -1, -1), emb.tokens(IDS)], 1)
        full = model(inputs_embeds=inputs).logits
        torch.testing.assert_close(peft(IDS).logits, full[:, 3:])
        # virtual tokens have no labels; the last one predicts the first real token (as in the PEFT library)
        loss = peft(IDS, labels=IDS).loss
        want = torch.nn.functional.cross_entropy(full[:, 2:-1].reshape(-1, 53), IDS.reshape(-1))
        torch.testing.assert_close(loss, want)


@pytest.mark.parametrize("method", ["prefix", "prompt", "lora"])
def test_encoder_decoder_generation(method):
    model = make("seq2seq")
    peft = get_peft_model(model, method, num_virtual_tokens=2)
    perturb(peft)
    out = peft.generate(IDS[:1], max_new_tokens=4, do_sample=False)
    assert out[0, 0] == 0 and out.shape[1] <= 5
    seq = out[:, :1]
    with torch.no_grad():
        for _ in range(out.shape[1] - 1):  # greedy without a cache
            nxt = peft(IDS[:1], decoder_input_ids=seq).logits[:, -1].argmax(-1, keepdim=True)
            seq = torch.cat([seq, nxt], 1)
    assert torch.equal(out, seq)


def test_adapter_and_ia3_formulas():
    from lmkit.peft import BottleneckAdapter, IA3Linear

    torch.manual_seed(0)
    sub = torch.nn.Linear(8, 8)
    adapter = BottleneckAdapter(sub, 8, 3)
    x = torch.randn(4, 8)
    torch.testing.assert_close(adapter(x), sub(x), rtol=0, atol=0)       # W_up = 0 at the start
    with torch.no_grad():
        adapter.adapter_up.weight.normal_()
    h = sub(x)
    want = h + adapter.adapter_up(torch.relu(adapter.adapter_down(h)))
    torch.testing.assert_close(adapter(x), want)
    base = torch.nn.Linear(8, 5)
    out_scaled, in_scaled = IA3Linear(base, feedforward=False), IA3Linear(base, feedforward=True)
    with torch.no_grad():
        out_scaled.ia3_l.uniform_(0, 2)
        in_scaled.ia3_l.uniform_(0, 2)
    torch.testing.assert_close(out_scaled(x), base(x) * out_scaled.ia3_l)                 # l * (W x + b)
    torch.testing.assert_close(in_scaled(x), (x * in_scaled.ia3_l) @ base.weight.t() + base.bias)  # W (l * a) + b


@pytest.mark.parametrize("missing", ["adapter_config.json", "adapter_model.safetensors"])
def test_missing_adapter_file_names_the_adapter_folder(tmp_path, missing):
    peft = get_peft_model(make("llama"), "lora", r=2)
    peft.save_adapter(tmp_path)
    (tmp_path / missing).unlink()
    with pytest.raises(CheckpointError, match=f"{missing} is missing; an adapter folder holds adapter_config.json"):
        load_adapter(make("llama"), tmp_path)
