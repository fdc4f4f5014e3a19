"""Compression: the distillation loss and student init, head importance and pruning, int8 quantization."""
import json
import math

import pytest
import torch
import torch.nn.functional as F

import lmkit
from lmkit.compress import (DistillWeights, distillation_loss, head_importance, least_important,
                            prune_heads, quantize_dynamic_int8, student_from_teacher, weight_bytes)
from lmkit.compress.prune import attention_modules, head_gates
from lmkit.config import ModelConfig
from lmkit.errors import ConfigError
from lmkit.models import build_model


BASE = dict(vocab_size=47, d_model=32, n_layers=4, n_heads=4, max_seq_len=32)
LLAMA = dict(BASE, position="rope", norm="rmsnorm", activation="swiglu", bias=False, n_kv_heads=2, family="llama")


def model_of(**kw):
    torch.manual_seed(kw.pop("seed", 0))
    return build_model(ModelConfig(**{**BASE, **kw})).eval()


IDS = torch.randint(0, 47, (3, 10), generator=torch.Generator().manual_seed(0))


# distillation ----------------------------------------------------------------------------------------

def test_distillation_loss_terms():
    g = torch.Generator().manual_seed(1)
    s, t = torch.randn(2, 5, 11, generator=g), torch.randn(2, 5, 11, generator=g)
    labels = torch.randint(0, 11, (2, 5), generator=g)
    labels[0, 0] = -100
    hs, ht = torch.randn(2, 5, 8, generator=g), torch.randn(2, 5, 8, generator=g)
    w = DistillWeights(alpha=0.3, beta=0.5, gamma=0.7, temperature=3.0)
    out = distillation_loss(s, t, labels, hs, ht, w)
    keep = labels.reshape(-1) != -100
    ps, pt = F.softmax(s.reshape(-1, 11)[keep] / 3, -1), F.softmax(t.reshape(-1, 11)[keep] / 3, -1)
    kl = (pt * (pt.log() - ps.log())).sum(-1).mean()
    cos = (1 - F.cosine_similarity(hs.reshape(-1, 8)[keep], ht.reshape(-1, 8)[keep], -1)).mean()
    ce = F.cross_entropy(s.reshape(-1, 11), labels.reshape(-1), ignore_index=-100)
    torch.testing.assert_close(out["kl"], kl)
    torch.testing.assert_close(out["cos"], cos)
    torch.testing.assert_close(out["loss"], 0.3 * ce + 0.5 * 9 * kl + 0.7 * cos)


def test_distillation_kl_is_distilberts_batchmean_kl_times_t_squared():
    g = torch.Generator().manual_seed(2)
    s, t = torch.randn(3, 6, 17, generator=g), 3 * torch.randn(3, 6, 17, generator=g)
    labels = torch.randint(0, 17, (3, 6), generator=g)
    labels[0, 4:] = -100                                   # padding
    labels[2, :] = -100
    T = 2.5
    out = distillation_loss(s, t, labels, weights=DistillWeights(alpha=0, beta=1, gamma=0, temperature=T))
    # DistilBERT's distiller: KLDivLoss(batchmean)(log_softmax(s / T), softmax(t / T)) * T^2 over the kept rows
    keep = labels != -100
    ref = torch.nn.KLDivLoss(reduction="batchmean")(F.log_softmax(s[keep] / T, -1), F.softmax(t[keep] / T, -1))
    torch.testing.assert_close(out["loss"], ref * T ** 2)
    torch.testing.assert_close(out["kl"], ref)
    # padded rows change nothing, whatever their logits
    s2, t2 = s.clone(), t.clone()
    s2[~keep], t2[~keep] = 50 * torch.randn(int((~keep).sum()), 17, generator=g), 0.0
    torch.testing.assert_close(distillation_loss(s2, t2, labels, weights=DistillWeights(temperature=T))["kl"], out["kl"])
    # a teacher logit of -inf (p_t = 0) adds 0 log 0 = 0, as in KLDivLoss, not NaN
    t3 = t.clone()
    t3[..., 0] = float("-inf")
    ref3 = torch.nn.KLDivLoss(reduction="batchmean")(F.log_softmax(s[keep] / T, -1), F.softmax(t3[keep] / T, -1))
    torch.testing.assert_close(distillation_loss(s, t3, labels, weights=DistillWeights(temperature=T))["kl"], ref3)


def test_distillation_loss_is_distilberts_mix_and_its_gradient_is_right():
    """DistilBERT's distiller computed apart: alpha_mlm CE + alpha_ce KLDivLoss(batchmean) T^2 + alpha_cos
    CosineEmbeddingLoss(target 1), all over the attended (non-padding) positions; and torch's gradcheck in
    float64 (the loss used to compute in float32 whatever the inputs' precision)."""
    g = torch.Generator().manual_seed(4)
    s = torch.randn(2, 5, 9, generator=g, dtype=torch.float64, requires_grad=True)
    t = torch.randn(2, 5, 9, generator=g, dtype=torch.float64)
    hs = torch.randn(2, 5, 6, generator=g, dtype=torch.float64, requires_grad=True)
    ht = torch.randn(2, 5, 6, generator=g, dtype=torch.float64)
    attention = torch.tensor([[1, 1, 1, 1, 1], [1, 1, 1, 0, 0]]).bool()
    labels = torch.randint(0, 9, (2, 5), generator=g).masked_fill(~attention, -100)
    w = DistillWeights(alpha=0.5, beta=3.0, gamma=2.0, temperature=1.7)
    out = distillation_loss(s, t, labels, hs, ht, w)
    T = 1.7
    kl = torch.nn.KLDivLoss(reduction="batchmean")(F.log_softmax(s[attention] / T, -1), F.softmax(t[attention] / T, -1))
    cos = torch.nn.CosineEmbeddingLoss()(hs[attention], ht[attention], torch.ones(int(attention.sum()), dtype=torch.float64))
    ce = F.cross_entropy(s[attention], labels[attention])
    assert out["loss"].dtype == torch.float64
    torch.testing.assert_close(out["loss"], 0.5 * ce + 3.0 * kl * T ** 2 + 2.0 * cos, rtol=1e-12, atol=1e-12)
    assert torch.autograd.gradcheck(lambda a, b: distillation_loss(a, t, labels, b, ht, w)["loss"], (s, hs))


@pytest.mark.parametrize("bad", [dict(temperature=0.0), dict(temperature=-1.0), dict(temperature=float("nan")),
                                 dict(beta=-1.0)])
def test_distill_weights_refuse_bad_values(bad):
    with pytest.raises(ConfigError, match="temperature must be a number > 0|weight beta must be"):
        DistillWeights(**bad)


def test_distillation_loss_vanishes_when_student_equals_teacher():
    z = torch.randn(4, 7, 13)
    h = torch.randn(4, 7, 6)
    out = distillation_loss(z, z.clone(), None, h, 2 * h, DistillWeights(alpha=1, beta=1, gamma=1))
    assert abs(float(out["kl"])) < 1e-6 and abs(float(out["cos"])) < 1e-6 and abs(float(out["loss"])) < 1e-5
    # the gradient of T^2 KL w.r.t. the student's logits is T (p_s - p_t) / n: it does not vanish as T grows
    s = torch.zeros(1, 1, 3, requires_grad=True)
    t = torch.tensor([[[2.0, 0.0, -1.0]]])
    grads = []
    for T in (1.0, 4.0, 16.0):
        s.grad = None
        distillation_loss(s, t, None, weights=DistillWeights(alpha=0, beta=1, gamma=0, temperature=T))["loss"].backward()
        want = T * (F.softmax(s.detach() / T, -1) - F.softmax(t / T, -1))
        torch.testing.assert_close(s.grad, want)
        grads.append(float(s.grad.abs().sum()))
    assert grads[2] > 0.1 * grads[0]


@pytest.mark.parametrize("kw", [dict(BASE), dict(LLAMA), dict(BASE, architecture="encoder", norm_placement="post",
                                                                 embedding_norm=True, extra={"head": "mlm"})])
def test_student_takes_every_other_teacher_layer(kw):
    teacher = model_of(**kw)
    student = student_from_teacher(teacher)
    stack = "decoder" if kw.get("architecture", "decoder") == "decoder" else "encoder"
    t_layers, s_layers = getattr(teacher, stack).layers, getattr(student, stack).layers
    assert len(s_layers) == 2 and student.config.n_layers == 2
    for i, j in ((0, 0), (1, 2)):
        for (n, p), (_, q) in zip(s_layers[i].named_parameters(), t_layers[j].named_parameters()):
            assert torch.equal(p, q), n
    # a teacher with its odd layers made the identity gives exactly the student's outputs
    for j in (1, 3):
        with torch.no_grad():
            t_layers[j].self_attn.sublayer.o_proj.weight.zero_()
            t_layers[j].mlp.sublayer.down_proj.weight.zero_()
            for name, p in t_layers[j].named_parameters():
                if name.endswith("bias") and ("o_proj" in name or "down_proj" in name):
                    p.zero_()
    if kw.get("norm_placement") != "post":  # post-norm adds a LayerNorm even around a zero branch
        with torch.no_grad():
            torch.testing.assert_close(student(IDS).logits, teacher(IDS).logits, rtol=1e-5, atol=1e-5)


def test_distillation_trains_student_toward_teacher():
    from lmkit.compress import distill_causal_lm

    class Stream:  # rows of a repeating pattern the teacher already knows
        def rows(self, seed, step, batch):
            g = torch.Generator().manual_seed(step)
            start = torch.randint(0, 5, (batch, 1), generator=g)
            return (start + torch.arange(9)) % 5 + 2

    teacher = model_of(n_layers=2, d_model=16, n_heads=2)
    opt = torch.optim.Adam(teacher.parameters(), 1e-2)
    teacher.train()
    for step in range(20):
        rows = Stream().rows(0, step, 8)
        loss = teacher(rows[:, :-1], labels=rows[:, :-1]).loss
        opt.zero_grad()
        loss.backward()
        opt.step()
    teacher.eval()
    student = student_from_teacher(teacher)
    probe = Stream().rows(0, 999, 8)[:, :-1]
    with torch.no_grad():
        start = distillation_loss(student(probe).logits, teacher(probe).logits)["kl"]
    hist = distill_causal_lm(teacher, student, Stream(), pad_id=0, steps=10, batch_size=8, lr=1e-2, warmup_steps=2)
    assert hist[-1]["loss"] < hist[0]["loss"]
    with torch.no_grad():
        assert distillation_loss(student(probe).logits, teacher(probe).logits)["kl"] < 0.7 * start


# head pruning -----------------------------------------------------------------------------------------

def test_head_gate_gradient_is_first_order_loss_change():
    model = model_of(seed=3).double()  # float64, so a small finite difference is exact enough
    rows = torch.randint(0, 47, (2, 9))
    imp = head_importance(model, [rows], normalize=False)
    name = "decoder.layers.1.self_attn.sublayer"
    with head_gates(model) as gates:
        base = F.cross_entropy(model(rows[:, :-1]).logits.reshape(-1, 47), rows[:, 1:].reshape(-1))
        eps = 1e-3
        with torch.no_grad():
            gates[name][2] -= eps
        moved = F.cross_entropy(model(rows[:, :-1]).logits.reshape(-1, 47), rows[:, 1:].reshape(-1))
    assert math.isclose(abs(float(moved - base)) / eps, float(imp[name][2]), rel_tol=1e-2, abs_tol=1e-7)


def test_gate_zero_equals_structural_removal():
    model = model_of(seed=4)
    name = "decoder.layers.0.self_attn.sublayer"
    with head_gates(model) as gates, torch.no_grad():
        gates[name][1] = 0
        gates[name][3] = 0
        want = model(IDS).logits
    n_before = model.num_parameters()
    prune_heads(model, {name: [1, 3]})
    with torch.no_grad():
        torch.testing.assert_close(model(IDS).logits, want, rtol=1e-5, atol=1e-5)
    assert model.num_parameters() == n_before - 2 * (3 * (8 * 32 + 8) + 8 * 32)  # q, k, v rows (+bias) and o columns of 2 heads


def test_pruned_model_saves_and_reloads(tmp_path):
    model = model_of(**LLAMA)
    imp = head_importance(model, [torch.randint(0, 47, (2, 9))])
    chosen = least_important(imp, 4, model)
    assert sum(len(v) for v in chosen.values()) == 4 and all(len(v) % 2 == 0 for v in chosen.values())  # GQA groups
    prune_heads(model, chosen)
    with torch.no_grad():
        want = model(IDS).logits
    model.save_pretrained(tmp_path)
    back = lmkit.load_model(tmp_path)
    with torch.no_grad():
        torch.testing.assert_close(back(IDS).logits, want)
    heads = [m.n_heads for m in back.modules() if hasattr(m, "n_kv_heads")]
    assert sum(heads) == 4 * 4 - 4


def masked_outputs(model, heads, ids, mask):
    """Logits (and greedy ids) of the unpruned model with `heads` zeroed at the input of o_proj, i.e. each
    masked head's attention output multiplied by 0 (transformers 4.x's head_mask)."""
    hooks = []
    for name, hs in heads.items():
        attn = model.get_submodule(name)

        def zero(module, args, hs=hs, dim=attn.head_dim):
            x = args[0].clone()
            for h in hs:
                x[..., h * dim:(h + 1) * dim] = 0
            return (x,)

        hooks.append(attn.o_proj.register_forward_pre_hook(zero))
    with torch.no_grad():
        logits = model(ids, attention_mask=mask).logits
        generated = model.generate(ids[:1], max_new_tokens=5) if model.config.architecture == "decoder" else None
    for h in hooks:
        h.remove()
    return logits, generated


ODD = dict(BASE, d_model=30, n_heads=3, n_layers=3)
GQA = dict(LLAMA, d_model=48, n_heads=6, n_kv_heads=3, n_layers=3)
PRUNE_CASES = {
    "gpt2-odd-heads": (dict(ODD, family="gpt2"), {0: [1], 2: [0, 2]}),
    "gpt2-all-heads-of-a-layer": (dict(ODD, family="gpt2"), {1: [0, 1, 2]}),
    "bert": (dict(ODD, architecture="encoder", norm_placement="post", embedding_norm=True, extra={"head": "mlm"}),
             {0: [2], 1: [0, 1, 2]}),
    "llama-gqa-whole-group": (GQA, {0: [2, 3]}),
    "llama-gqa-part-of-a-group": (GQA, {1: [0], 2: [1, 2, 5]}),     # key/value heads repeated, none removed
    "llama-gqa-every-head": (GQA, {1: list(range(6))}),
    "llama-mqa-single-heads": (dict(GQA, n_kv_heads=1), {0: [3], 2: [0, 1, 4]}),
}


@pytest.mark.parametrize("case", PRUNE_CASES)
def test_pruning_equals_masking_the_heads(case, tmp_path):
    kw, layers = PRUNE_CASES[case]
    model = model_of(**kw, seed=7)
    stack = "encoder" if kw.get("architecture") == "encoder" else "decoder"
    heads = {f"{stack}.layers.{i}.self_attn.sublayer": hs for i, hs in layers.items()}
    ids = torch.randint(0, 47, (2, 9), generator=torch.Generator().manual_seed(1))
    mask = torch.ones_like(ids)
    mask[1, :3] = 0                                                    # left padding
    want, want_ids = masked_outputs(model, heads, ids, mask)
    n_before = model.num_parameters()
    prune_heads(model, heads)
    with torch.no_grad():
        got = model(ids, attention_mask=mask).logits
        torch.testing.assert_close(got[mask.bool()], want[mask.bool()], rtol=0, atol=1e-6)
        if want_ids is not None:
            assert model.generate(ids[:1], max_new_tokens=5).tolist() == want_ids.tolist()
    for name, hs in heads.items():
        attn = model.get_submodule(name)
        assert attn.n_heads == kw["n_heads"] - len(hs)
        assert attn.q_proj.out_features == attn.o_proj.in_features == attn.n_heads * attn.head_dim
        assert attn.k_proj.out_features == attn.n_kv_heads * attn.head_dim
        assert attn.n_heads == 0 or attn.n_heads % attn.n_kv_heads == 0
    assert model.num_parameters() < n_before
    model.save_pretrained(tmp_path)
    back = lmkit.load_model(tmp_path)
    with torch.no_grad():
        torch.testing.assert_close(back(ids, attention_mask=mask).logits, got, rtol=0, atol=0)


@pytest.mark.parametrize("case", ["gpt2-odd-heads", "llama-gqa-part-of-a-group", "bert"])
def test_repeated_pruning_numbers_heads_as_transformers_does(case, tmp_path):
    """transformers' prune_heads takes the original head indices every time and skips heads pruned before
    (config.pruned_heads keeps the union); lmkit used to read a second call's indices as the current heads."""
    kw, _ = PRUNE_CASES[case]
    stack = "encoder" if kw.get("architecture") == "encoder" else "decoder"
    a, b = (f"{stack}.layers.{i}.self_attn.sublayer" for i in (0, 2))
    ids = torch.randint(0, 47, (2, 9), generator=torch.Generator().manual_seed(1))
    model = model_of(**kw, seed=7)
    want, _ = masked_outputs(model, {a: [0, 2], b: [1]}, ids, None)
    prune_heads(model, {a: [2]})
    model.save_pretrained(tmp_path)
    back = lmkit.load_model(tmp_path)
    prune_heads(back, {a: [0, 2], b: [1]})                 # 2 again: already gone, skipped
    assert back.config.compression.pruned_heads == {a: [0, 2], b: [1]}
    assert back.get_submodule(a).n_heads == kw["n_heads"] - 2
    with torch.no_grad():
        torch.testing.assert_close(back(ids).logits, want, rtol=0, atol=1e-6)
    n = kw["n_heads"]
    with pytest.raises(ConfigError, match=rf"has {n} heads, numbered 0..{n - 1}; head indices \[{n}\]"):
        prune_heads(back, {a: [n]})                        # the range is the original one
    imp = head_importance(back, [torch.randint(0, 47, (2, 9))])
    chosen = least_important(imp, 1, back)                 # reported in the original numbering too
    assert all(h not in back.config.compression.pruned_heads.get(name, []) for name, hs in chosen.items() for h in hs)


def test_pruned_layer_without_heads_still_trains():
    model = model_of(**GQA)
    prune_heads(model, {"decoder.layers.1.self_attn.sublayer": list(range(6))})
    model.train()
    model(IDS, labels=IDS).loss.backward()
    assert model.decoder.layers[0].self_attn.sublayer.q_proj.weight.grad.abs().sum() > 0


def test_prune_errors():
    model = model_of(**LLAMA)
    name = "decoder.layers.0.self_attn.sublayer"
    for bad in ([4], [-1]):
        with pytest.raises(ConfigError, match=r"has 4 heads, numbered 0..3; head indices \[-?\d\] are out of range"):
            prune_heads(model, {"decoder.layers.1.self_attn.sublayer": [0, 1], name: bad})
    with pytest.raises(ConfigError, match="not an attention module"):
        prune_heads(model, {"decoder.layers.9.self_attn.sublayer": [0]})
    assert all(layer.self_attn.sublayer.n_heads == 4 for layer in model.decoder.layers)  # nothing half-done
    from lmkit.peft import get_peft_model

    lora = get_peft_model(model_of(**LLAMA), "lora", r=2, target_modules=["v_proj"])
    with pytest.raises(ConfigError, match="merge adapters"):
        prune_heads(lora.base_model, {name: [0, 1]})
    imp = head_importance(model, [torch.randint(0, 47, (2, 9))])
    with pytest.raises(ConfigError, match="cannot prune exactly 3 heads .*; 2 or 4 can be"):  # GQA: groups of 2
        least_important(imp, 3, model)
    most = sum(a.n_heads - a.n_heads // a.n_kv_heads for a in attention_modules(model).values())
    with pytest.raises(ConfigError, match=f"cannot prune exactly {most + 2} heads .*; {most} can be"):  # a group kept
        least_important(imp, most + 2, model)


def test_least_important_prunes_single_heads_under_mqa():
    model = model_of(**dict(LLAMA, n_kv_heads=1))
    imp = head_importance(model, [torch.randint(0, 47, (2, 9))])
    chosen = least_important(imp, 5, model)
    assert sum(map(len, chosen.values())) == 5
    flat = sorted((float(imp[n][h]), n, h) for n in imp for h in range(4))
    assert {(n, h) for _, n, h in flat[:5]} == {(n, h) for n, hs in chosen.items() for h in hs}  # lowest five
    prune_heads(model, chosen)
    assert sum(m.n_heads for m in model.modules() if hasattr(m, "n_kv_heads")) == 16 - 5


# quantization -----------------------------------------------------------------------------------------

def test_dynamic_int8_is_smaller_and_close():
    model = model_of(d_model=64, n_heads=4, seed=5)
    q = quantize_dynamic_int8(model)
    with torch.no_grad():
        ref, got = model(IDS).logits, q(IDS).logits
    assert (got - ref).abs().max() < 0.05 * ref.abs().max()
    assert weight_bytes(q) < 0.6 * weight_bytes(model)
    assert type(q.lm_head).__name__ == "Linear" and not hasattr(q.lm_head, "_packed_params")  # tied head kept
    assert hasattr(q.decoder.layers[0].mlp.sublayer.up_proj, "_packed_params")


@pytest.mark.parametrize("kw", [dict(BASE, tie_embeddings=False, d_model=64), dict(LLAMA, d_model=64),
                                dict(LLAMA, d_model=64, n_experts=3, family="mixtral")])
def test_int8_equals_torch_quantize_dynamic_and_reloads(kw, tmp_path):
    import copy
    import warnings

    from safetensors import safe_open

    model = model_of(**kw, seed=6)
    q = quantize_dynamic_int8(model)
    # the reference: torch's quantize_dynamic on every nn.Linear but a head tied to the embeddings
    tied = model.lm_head.weight is model.decoder.embeddings.tokens.weight
    spec = {n for n, m in model.named_modules() if isinstance(m, torch.nn.Linear) and not (tied and n == "lm_head")}
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        ref = torch.ao.quantization.quantize_dynamic(copy.deepcopy(model), spec if tied else {torch.nn.Linear},
                                                     dtype=torch.qint8)
    with torch.no_grad():
        want = ref(IDS).logits
        torch.testing.assert_close(q(IDS).logits, want, rtol=0, atol=0)
    q.save_pretrained(tmp_path)
    assert sorted(p.name for p in tmp_path.iterdir()) == ["config.json", "model.safetensors"]
    with safe_open(str(tmp_path / "model.safetensors"), "pt") as f:
        stored = {k: f.get_tensor(k) for k in f.keys()}
    assert stored["decoder.layers.0.self_attn.sublayer.q_proj.weight"].dtype == torch.int8
    assert weight_bytes(q) == sum(t.nbytes for t in stored.values())          # the size reported is the size saved
    back = lmkit.load_model(tmp_path)
    with torch.no_grad():
        torch.testing.assert_close(back(IDS).logits, want, rtol=0, atol=0)
        assert back.generate(IDS[:1], max_new_tokens=4).tolist() == q.generate(IDS[:1], max_new_tokens=4).tolist()
    with pytest.raises(ConfigError, match="runs in float32"):
        lmkit.load_model(tmp_path, dtype=torch.bfloat16)


def test_int8_keeps_empty_layers_in_float():
    model = model_of(d_model=64, seed=8)
    prune_heads(model, {"decoder.layers.1.self_attn.sublayer": [0, 1, 2, 3]})   # q (d -> 0) and o (0 -> d)
    q = quantize_dynamic_int8(model)
    attn = q.decoder.layers[1].self_attn.sublayer
    assert type(attn.o_proj) is torch.nn.Linear and hasattr(q.decoder.layers[0].self_attn.sublayer.o_proj, "_packed_params")
    with torch.no_grad():   # the int8 kernel with 0 inputs returns uninitialised memory, not the bias
        ref, got = model(IDS).logits, q(IDS).logits
    assert (got - ref).abs().max() < 0.05 * ref.abs().max()


def test_int8_weights_follow_torchs_symmetric_per_tensor_math(tmp_path):
    """torch's dynamic qint8 weights (MinMaxObserver, per_tensor_symmetric): s = max|w| / 127.5, zero point 0,
    q = clamp(round(w * (1 / s)), -128, 127), so |w - s q| <= s / 2; the saved folder holds exactly q and s."""
    from safetensors import safe_open
    from lmkit.compress.quantize import quantized_linears

    model = model_of(d_model=64, tie_embeddings=False, seed=10)
    q = quantize_dynamic_int8(model)
    layers = quantized_linears(q)
    assert len(layers) == 4 * 6 + 1                                  # q, k, v, o, up, down per layer; the untied head
    q.save_pretrained(tmp_path)
    back = quantized_linears(lmkit.load_model(tmp_path))
    with safe_open(str(tmp_path / "model.safetensors"), "pt") as f:
        for name, layer in layers.items():
            w, qw = model.get_submodule(name).weight.detach(), layer.weight()
            s = w.abs().max() / torch.tensor(127.5)
            assert qw.q_scale() == float(s) and qw.q_zero_point() == 0
            want = torch.clamp(torch.round(w * (1 / s)), -128, 127).to(torch.int8)
            assert torch.equal(qw.int_repr(), want), name
            # |w / s - q| <= 1/2, up to the float32 product w * (1 / s): |w| / s <= 128 times 2^-23 more
            assert float((w.double() - float(s) * want.double()).abs().max()) <= float(s) * (0.5 + 128 * 2 ** -23)
            assert torch.equal(f.get_tensor(f"{name}.weight"), want) and float(f.get_tensor(f"{name}.weight_scale")) == float(s)
            again = back[name].weight()                              # reloaded bit for bit
            assert torch.equal(again.int_repr(), want) and again.q_scale() == qw.q_scale()


def test_int8_tied_head_named_explicitly_saves_apart_from_the_embedding(tmp_path):
    """A tied head quantized on request used to save with tie_embeddings still set: the reloaded model tied the
    dequantized head back to the embedding (the float embedding changed, outputs moved). A name given twice
    was recorded twice, and the folder did not load."""
    model = model_of(d_model=64, seed=11)
    up = "decoder.layers.0.mlp.sublayer.up_proj"
    q = quantize_dynamic_int8(model, ["lm_head", up, up])           # a name given twice is one layer
    assert not q.config.tie_embeddings and q.config.compression.quantization["modules"] == sorted([up, "lm_head"])
    q.save_pretrained(tmp_path)
    back = lmkit.load_model(tmp_path)
    torch.testing.assert_close(back.decoder.embeddings.tokens.weight, model.decoder.embeddings.tokens.weight,
                               rtol=0, atol=0)
    with torch.no_grad():
        torch.testing.assert_close(back(IDS).logits, q(IDS).logits, rtol=0, atol=0)


@pytest.mark.parametrize("name,words", [("decoder.layers.0.self_attn.sublayer.q_pro", "is not a layer of this model"),
                                        ("decoder", "is Stack, not nn.Linear"),
                                        ("decoder.embeddings.tokens", "is Embedding, not nn.Linear")])
def test_quantize_refuses_names_that_are_not_linear_layers(name, words):
    """torch's quantize_dynamic skips an unknown name (lmkit then recorded it and saved a folder it could not
    load) and fails with an assertion on an Embedding; both are refused by name."""
    with pytest.raises(ConfigError, match=f"cannot quantize '{name}': it {words}"):
        quantize_dynamic_int8(model_of(seed=12), [name])


def test_quantize_errors():
    with pytest.raises(ConfigError, match="no float nn.Linear layer to quantize"):
        quantize_dynamic_int8(torch.nn.Sequential(torch.nn.Embedding(5, 3), torch.nn.LayerNorm(3)))
    q = quantize_dynamic_int8(model_of(seed=9))
    with pytest.raises(ConfigError, match="already quantized"):
        quantize_dynamic_int8(q)


def _hf_pruned_folder(kind, folder, pruned):
    """A folder as transformers 4.x's prune_heads saved it (5.x cannot prune: its slicing done here), and the
    reference: the unpruned model with those heads' output columns zeroed (what pruning them computes)."""
    transformers = pytest.importorskip("transformers")
    from safetensors.torch import load_file, save_file

    torch.manual_seed(0)
    if kind == "gpt2":
        ref = transformers.GPT2LMHeadModel(transformers.GPT2Config(vocab_size=47, n_embd=32, n_layer=2, n_head=4,
                                                                   n_positions=32))
        qkv = ["transformer.h.{}.attn.c_attn.weight", "transformer.h.{}.attn.c_attn.bias"]
        out, out_dim = "transformer.h.{}.attn.c_proj.weight", 0                   # Conv1D: (in, out)
    else:
        cls, cfg = {"bert": ("BertForMaskedLM", "BertConfig"), "distilbert": ("DistilBertForMaskedLM", "DistilBertConfig")}[kind]
        cfg = getattr(transformers, cfg)(vocab_size=47, hidden_size=32, dim=32, num_hidden_layers=2, n_layers=2,
                                         num_attention_heads=4, n_heads=4, intermediate_size=40, hidden_dim=40,
                                         max_position_embeddings=32)
        ref = getattr(transformers, cls)(cfg)
        pre = "bert.encoder.layer.{}.attention." if kind == "bert" else "distilbert.transformer.layer.{}.attention."
        names = ("self.query", "self.key", "self.value", "output.dense") if kind == "bert" else ("q_lin", "k_lin",
                                                                                                   "v_lin", "out_lin")
        qkv = [pre + n + s for n in names[:3] for s in (".weight", ".bias")]
        out, out_dim = pre + names[3] + ".weight", 1
    ref.eval().save_pretrained(folder)
    state = load_file(folder / "model.safetensors")
    for layer, heads in pruned.items():
        rows = torch.tensor([i for h in range(4) if h not in heads for i in range(8 * h, 8 * h + 8)], dtype=torch.long)
        for key in qkv:
            t = state[key.format(layer)]
            index = torch.cat([rows, rows + 32, rows + 64]) if kind == "gpt2" else rows   # c_attn holds q, k, v
            state[key.format(layer)] = t.index_select(t.dim() - 1 if kind == "gpt2" else 0, index).contiguous()
        state[out.format(layer)] = state[out.format(layer)].index_select(out_dim, rows).contiguous()
        with torch.no_grad():
            w = ref.get_parameter(out.format(layer))
            for h in heads:
                w.narrow(out_dim, 8 * h, 8).zero_()
    save_file(state, folder / "model.safetensors", metadata={"format": "pt"})
    config = json.loads((folder / "config.json").read_text())
    (folder / "config.json").write_text(json.dumps({**config, "pruned_heads": {str(k): v for k, v in pruned.items()}}))
    return ref


@pytest.mark.parametrize("kind", ["bert", "distilbert", "gpt2"])
def test_transformers_4_pruned_folders_load(kind, tmp_path):
    """config.json's pruned_heads (uneven heads per layer, a layer with none left) used to be refused as weights that
    disagree with the config; it loads as lmkit's own pruning of those original heads, and prunes further."""
    ref = _hf_pruned_folder(kind, tmp_path, {0: [1, 3], 1: [0, 1, 2, 3]})
    model = lmkit.load_model(tmp_path)
    stack = "decoder" if kind == "gpt2" else "encoder"
    name = f"{stack}.layers.0.self_attn.sublayer"
    assert model.config.compression.pruned_heads == {name: [1, 3], f"{stack}.layers.1.self_attn.sublayer": [0, 1, 2, 3]}
    with torch.no_grad():
        want = ref(input_ids=IDS).logits
        torch.testing.assert_close(model(IDS).logits, want, rtol=1e-5, atol=1e-5)
    model.save_pretrained(tmp_path / "again")            # lmkit's format: transformers 5 reads no pruned_heads
    back = lmkit.load_model(tmp_path / "again")
    with torch.no_grad():
        torch.testing.assert_close(back(IDS).logits, want, rtol=1e-5, atol=1e-5)
    prune_heads(back, {name: [3, 2]})                     # original numbering: 3 is gone already, 2 goes
    assert back.get_submodule(name).n_heads == 1 and back.config.compression.pruned_heads[name] == [1, 2, 3]


def test_bad_pruned_heads_in_config_json_are_refused(tmp_path):
    _hf_pruned_folder("bert", tmp_path, {})
    config = json.loads((tmp_path / "config.json").read_text())
    (tmp_path / "config.json").write_text(json.dumps({**config, "pruned_heads": {"5": [0]}}))
    with pytest.raises(ConfigError, match="pruned_heads .* names a layer or head this model"):
        lmkit.load_model(tmp_path)


@pytest.mark.parametrize("heads", [[2, 3], [1], [0, 1, 2, 3, 4, 5]])
def test_pruned_gqa_llama_equals_transformers_with_those_heads_zeroed(heads, tmp_path):
    """A Hugging Face Llama with grouped-query attention (6 query heads, 3 key/value heads): pruning a whole group,
    part of one or every head gives transformers' outputs with those heads' o_proj columns zeroed."""
    transformers = pytest.importorskip("transformers")
    torch.manual_seed(0)
    ref = transformers.LlamaForCausalLM(transformers.LlamaConfig(
        vocab_size=47, hidden_size=48, intermediate_size=40, num_hidden_layers=2, num_attention_heads=6,
        num_key_value_heads=3, max_position_embeddings=32)).eval()
    ref.save_pretrained(tmp_path)
    model = lmkit.load_model(tmp_path)
    name = "decoder.layers.1.self_attn.sublayer"
    prune_heads(model, {name: heads})
    with torch.no_grad():
        for h in heads:
            ref.model.layers[1].self_attn.o_proj.weight[:, 8 * h:8 * h + 8] = 0
        torch.testing.assert_close(model(IDS).logits, ref(input_ids=IDS).logits, rtol=1e-5, atol=1e-5)
    attn = model.get_submodule(name)
    assert attn.n_kv_heads == {2: 2, 1: 5, 6: 0}[len(heads)]   # a whole group takes its key/value head along
