"""Mixture-of-experts feed-forward: routing, equivalences and the load-balancing loss."""
import math

import pytest
import torch

import lmkit
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


def reference_balance_loss(layer_logits, n, k, mask=None):
    """transformers 4.x's load_balancing_loss_func, written out: concatenate layers, mask rows, N * sum f P."""
    logits = torch.cat(layer_logits)
    probs = torch.softmax(logits, -1)
    hits = torch.nn.functional.one_hot(probs.topk(k, -1).indices, n).float()        # (rows, k, N)
    if mask is None:
        return n * (hits.mean(0).sum(0) * probs.mean(0)).sum()
    w = mask.reshape(-1).float().repeat(len(layer_logits))
    f = (hits * w[:, None, None]).sum(0).sum(0) / w.sum()
    p = (probs * w[:, None]).sum(0) / w.sum()
    return n * (f * p).sum()


def test_aux_loss_is_minimal_for_uniform_router():
    n, k = 8, 2
    base = load_balancing_loss(torch.zeros(64, n), n, k)       # uniform probabilities: L = sum_e f_e = k
    assert math.isclose(float(base), k, rel_tol=1e-6)
    g = torch.Generator().manual_seed(0)
    for scale in (0.5, 2.0, 8.0):
        logits = scale * torch.randn(64, n, generator=g)
        assert float(load_balancing_loss(logits, n, k)) >= float(base) - 1e-6
    # a collapsed router (every token to the same experts) is penalised the most
    collapsed = torch.tensor([10.0, 9.0] + [0.0] * (n - 2)).expand(64, n)
    assert float(load_balancing_loss(collapsed, n, k)) > 3 * k


def test_aux_loss_pools_layers_and_skips_padding():
    g = torch.Generator().manual_seed(5)
    n, k = 5, 3
    layers = [torch.randn(12, n, generator=g) for _ in range(3)]
    mask = torch.tensor([[0, 0, 1, 1, 1, 1], [1, 1, 1, 1, 1, 1]])
    torch.testing.assert_close(load_balancing_loss(layers, n, k, mask), reference_balance_loss(layers, n, k, mask))
    torch.testing.assert_close(load_balancing_loss(layers, n, k), reference_balance_loss(layers, n, k))
    # pooled, not a sum (nor a mean) of per-layer losses
    per_layer = [float(load_balancing_loss(layer, n, k, mask)) for layer in layers]
    assert not math.isclose(float(load_balancing_loss(layers, n, k, mask)), sum(per_layer) / 3, rel_tol=1e-4)
    # padded rows change nothing, whatever their logits
    changed = [layer.clone() for layer in layers]
    for layer in changed:
        layer[:2] = 100 * torch.randn(2, n, generator=g)
    torch.testing.assert_close(load_balancing_loss(changed, n, k, mask), load_balancing_loss(layers, n, k, mask))


def test_model_aux_loss_is_unscaled_pooled_and_masked():
    torch.manual_seed(3)
    model = CausalLM(cfg(router_aux_loss_coef=0.5, n_layers=3))
    ids = torch.randint(0, 61, (2, 6))
    mask = torch.tensor([[0, 0, 1, 1, 1, 1], [1, 1, 1, 1, 1, 1]])
    out = model(ids, attention_mask=mask)
    layers = [layer.mlp.sublayer.gate(h) for layer, h in zip(model.decoder.layers, _moe_inputs(model, ids, mask))]
    assert len(out.router_logits) == 3
    for got, want in zip(out.router_logits, layers):
        torch.testing.assert_close(got, want)
    torch.testing.assert_close(out.aux_loss, reference_balance_loss(layers, 5, 2, mask))
    out.aux_loss.backward()
    assert model.decoder.layers[0].mlp.sublayer.gate.weight.grad.abs().sum() > 0


def _moe_inputs(model, ids, mask):
    """The inputs each MoE layer saw (recorded with forward pre-hooks)."""
    seen = []
    hooks = [layer.mlp.sublayer.register_forward_pre_hook(lambda m, a: seen.append(a[0].reshape(-1, a[0].shape[-1])))
             for layer in model.decoder.layers]
    with torch.no_grad():
        model(ids, attention_mask=mask)
    for h in hooks:
        h.remove()
    return seen


def test_loss_adds_the_weighted_aux_loss_only_when_asked():
    torch.manual_seed(6)
    model = CausalLM(cfg(router_aux_loss_coef=0.25))
    ids = torch.randint(0, 61, (2, 7))
    labels = ids.clone()
    labels[0, :2] = -100
    plain = model(ids, labels=labels)
    asked = model(ids, labels=labels, output_router_logits=True)
    ce = torch.nn.functional.cross_entropy(plain.logits[:, :-1].reshape(-1, 61), labels[:, 1:].reshape(-1))
    torch.testing.assert_close(plain.loss, ce)
    torch.testing.assert_close(asked.loss, ce + 0.25 * asked.aux_loss)
    model.config.output_router_logits = True      # config.json's output_router_logits is the default
    torch.testing.assert_close(model(ids, labels=labels).loss, asked.loss)


def test_trainer_adds_the_coefficient_times_the_aux_loss(corpus_file, tmp_path, monkeypatch):
    from lmkit.train import TrainConfig, Trainer

    overrides = dict(d_model=32, n_layers=2, n_heads=4, n_kv_heads=2, d_ff=24, n_experts=3, router_aux_loss_coef=0.3)
    trainer = Trainer(TrainConfig(preset="moe", model_overrides=overrides, corpus=[corpus_file], out=str(tmp_path / "r"),
                                  max_steps=2, batch_size=2, seq_len=16, precision="fp32", progress=False, grad_clip=0.0,
                                  save_every=None))
    twin = CausalLM(trainer.model_config)
    twin.load_state_dict(trainer.model.state_dict())
    twin.train()
    monkeypatch.setattr(trainer.optimizer, "step", lambda: None)
    monkeypatch.setattr(trainer.optimizer, "zero_grad", lambda set_to_none=True: None)
    rows = trainer.stream.rows(trainer.cfg.seed, 0, 2, 0, 1)
    batch = trainer.objective.build_batch(rows, trainer.pad_id, None)
    trainer.train_step(0)
    # transformers' training loss: mean next-token cross-entropy + coef * aux_loss
    out = twin(batch["input_ids"], output_router_logits=True)
    ce = torch.nn.functional.cross_entropy(out.logits.reshape(-1, out.logits.shape[-1]), batch["labels"].reshape(-1))
    (ce + 0.3 * out.aux_loss).backward()
    for (name, p), q in zip(trainer.model.named_parameters(), twin.parameters()):
        torch.testing.assert_close(p.grad, q.grad, rtol=1e-4, atol=1e-6, msg=name)


def test_mlm_trainer_adds_the_coefficient_times_a_moe_encoders_aux_loss(corpus_file, tmp_path, monkeypatch):
    """An encoder with experts returns its aux_loss (padding left out), so --objective mlm balances the load too."""
    from lmkit.models.encoder import Encoder
    from lmkit.objectives import masked_lm_loss
    from lmkit.train import TrainConfig, Trainer

    overrides = dict(d_model=32, n_layers=2, n_heads=2, d_ff=24, dropout=0.0, attention_dropout=0.0, n_experts=3,
                     router_aux_loss_coef=0.3, family=None)     # lmkit's own format: BERT's has no experts
    trainer = Trainer(TrainConfig(preset="bert", objective="mlm", model_overrides=overrides, corpus=[corpus_file],
                                  out=str(tmp_path / "r"), max_steps=1, batch_size=2, seq_len=16, vocab_size=400,
                                  precision="fp32", progress=False, grad_clip=0.0, save_every=None))
    twin = Encoder(trainer.model_config)
    twin.load_state_dict(trainer.model.state_dict())
    twin.train()
    seen = []
    loss = trainer.objective.loss
    monkeypatch.setattr(trainer.objective, "loss", lambda model, batch: seen.append(batch) or loss(model, batch))
    monkeypatch.setattr(trainer.optimizer, "step", lambda: None)
    monkeypatch.setattr(trainer.optimizer, "zero_grad", lambda set_to_none=True: None)
    trainer.train_step(0)
    (batch,) = seen
    batch["attention_mask"][0, -3:] = 0                     # padded rows leave the balance loss
    out = twin(batch["input_ids"], attention_mask=batch["attention_mask"])
    want = reference_balance_loss(out.router_logits, 3, 2, batch["attention_mask"])
    torch.testing.assert_close(out.aux_loss, want)
    batch["attention_mask"][0, -3:] = 1
    out = twin(batch["input_ids"], attention_mask=batch["attention_mask"])
    (masked_lm_loss(out.logits, batch["labels"]).mean + 0.3 * out.aux_loss).backward()
    for (name, p), q in zip(trainer.model.named_parameters(), twin.parameters()):
        torch.testing.assert_close(p.grad, q.grad, rtol=1e-4, atol=1e-6, msg=name)


def test_trainer_refuses_experts_its_folder_format_cannot_hold_before_the_first_step(corpus_file, tmp_path):
    """A BERT (or LLaMA) folder has no experts: the run stops at once, not at its first save after training."""
    from lmkit.errors import ConfigError
    from lmkit.train import TrainConfig, Trainer

    for preset, objective in (("bert", "mlm"), ("llama", "clm")):
        overrides = dict(d_model=32, n_layers=1, n_heads=2, n_kv_heads=2, d_ff=24, n_experts=3)
        cfg = TrainConfig(preset=preset, objective=objective, model_overrides=overrides, corpus=[corpus_file],
                          out=str(tmp_path / preset), max_steps=1, batch_size=2, seq_len=16, vocab_size=400,
                          precision="fp32", progress=False)
        with pytest.raises(ConfigError, match="mixture of experts"):
            Trainer(cfg)
        assert not (tmp_path / preset / "metrics.jsonl").exists()
    cfg.model_overrides["family"] = None                      # lmkit's own format holds them
    Trainer(cfg).fit()
    model = lmkit.load_model(tmp_path / "llama")
    assert model.config.n_experts == 3 and model(torch.tensor([[1, 2, 3]])).aux_loss is not None


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
