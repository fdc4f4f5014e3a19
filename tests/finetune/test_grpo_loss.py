"""GRPO's loss against TRL's GRPOTrainer.compute_loss: fixed prompts, injected completions, fixed advantages, an
old policy and a reference model that differ from the policy; loss, per-token KL, clip fractions and gradients."""
from __future__ import annotations

import pytest
import torch

from helpers.hf_folders import build
from lmkit.finetune.grpo_loss import GRPOObjective, completion_logps, group_advantages
from lmkit.hub import check_savable, load_model
from lmkit.hub.convert import to_hf

transformers = pytest.importorskip("transformers")
trl = pytest.importorskip("trl")
datasets = pytest.importorskip("datasets")

TEMPERATURE, EPS, EPS_HIGH, BETA, MAX_LEN = 0.7, 0.2, 0.28, 0.04, 7


@pytest.fixture(scope="module")
def pairs(tmp_path_factory):
    """family -> (policy folder, reference folder): the policy is the reference with its weights moved."""
    out = {}
    for family in ("gpt2", "llama"):
        root = tmp_path_factory.mktemp(family)
        ref = build(family, root / "ref")
        model = transformers.AutoModelForCausalLM.from_pretrained(ref)
        torch.manual_seed(1)
        with torch.no_grad():
            for p in model.parameters():
                p.add_(0.05 * torch.randn_like(p))
        model.save_pretrained(root / "policy")
        transformers.AutoTokenizer.from_pretrained(ref).save_pretrained(root / "policy")
        out[family] = (str(root / "policy"), ref)
    return out


def _inputs(family: str, vocab: int):
    """Prompts (left-padded; of one length for GPT-2, whose learned positions transformers counts over the padding)
    and completions (right-padded, odd lengths), 2 prompts x 3 completions."""
    g = torch.Generator().manual_seed(3)
    B, P, C = 6, 5, MAX_LEN - 1
    prompt_ids = torch.randint(3, vocab, (B, P), generator=g)
    prompt_mask = torch.ones(B, P, dtype=torch.long)
    if family == "llama":
        prompt_ids[:3, :2] = 0
        prompt_mask[:3, :2] = 0
        prompt_ids[:3, 2] = 1  # BOS after the padding
    completion_ids = torch.randint(3, vocab, (B, C), generator=g)
    lengths = torch.tensor([6, 1, 4, 3, 6, 5])
    completion_mask = (torch.arange(C)[None] < lengths[:, None]).long()
    completion_ids = completion_ids * completion_mask  # padding id 0 after each completion
    rewards = torch.tensor([1.0, 0.0, 0.5, 2.0, -1.0, 0.25])
    return prompt_ids, prompt_mask, completion_ids, completion_mask, rewards


def _trainer(policy: str, ref: str, loss_type: str, tmp_path):
    args = trl.GRPOConfig(output_dir=str(tmp_path / "trl"), num_generations=3, per_device_train_batch_size=6,
                          beta=BETA, epsilon=EPS, epsilon_high=EPS_HIGH, temperature=TEMPERATURE, loss_type=loss_type,
                          max_completion_length=MAX_LEN, report_to=[], use_cpu=True, bf16=False,
                          disable_dropout=True)
    data = datasets.Dataset.from_list([{"prompt": "hello"}] * 6)
    tok = transformers.AutoTokenizer.from_pretrained(policy)
    trainer = trl.GRPOTrainer(model=policy, reward_funcs=lambda prompts, completions, **kw: [0.0] * len(prompts),
                              args=args, train_dataset=data, processing_class=tok)
    trainer.ref_model.load_state_dict(transformers.AutoModelForCausalLM.from_pretrained(ref).state_dict())
    trainer.current_gradient_accumulation_steps = 1
    trainer.model.train()
    return trainer


def _hf_grads(model) -> dict[str, torch.Tensor]:
    family, _ = check_savable(model)
    state = {name: (p.grad if p.grad is not None else torch.zeros_like(p))
             for name, p in model.named_parameters(remove_duplicate=False)}
    state.update({name: b for name, b in model.named_buffers()})
    return to_hf(state, family.rules(model.config))


@pytest.mark.parametrize("family", ["gpt2", "llama"])
@pytest.mark.parametrize("loss_type", ["grpo", "bnpo", "dr_grpo", "dapo"])
def test_loss_kl_clip_fractions_and_gradients_equal_trl(pairs, tmp_path, family, loss_type):
    policy, ref = pairs[family]
    trainer = _trainer(policy, ref, loss_type, tmp_path)
    vocab = trainer.model.config.vocab_size
    prompt_ids, prompt_mask, completion_ids, completion_mask, rewards = _inputs(family, vocab)
    advantages, _ = group_advantages(rewards, 3)
    ids, mask = torch.cat([prompt_ids, completion_ids], 1), torch.cat([prompt_mask, completion_mask], 1)
    with torch.no_grad():
        ref_logps = trainer._get_per_token_logps_and_entropies(trainer.ref_model, ids, mask, MAX_LEN - 1)[0]
        now = trainer._get_per_token_logps_and_entropies(trainer.model, ids, mask, MAX_LEN - 1)[0]
    noise = 0.3 * torch.randn(now.shape, generator=torch.Generator().manual_seed(4))
    old_logps = (now + noise) * completion_mask  # an older policy: some ratios leave [1 - eps, 1 + eps_high]
    inputs = dict(prompt_ids=prompt_ids, prompt_mask=prompt_mask, completion_ids=completion_ids,
                  completion_mask=completion_mask, advantages=advantages, old_per_token_logps=old_logps,
                  ref_per_token_logps=ref_logps, num_items_in_batch=completion_mask.sum())
    expected = trainer._compute_loss(trainer.model, inputs)
    expected.backward()
    metrics = {k: v[-1] for k, v in trainer._metrics["train"].items()}

    model, reference = load_model(policy), load_model(ref)  # eval mode: no dropout, as TRL's disable_dropout
    objective = GRPOObjective(loss_type, beta=BETA, epsilon=EPS, epsilon_high=EPS_HIGH, temperature=TEMPERATURE,
                              max_completion_length=MAX_LEN)
    with torch.no_grad():
        ours_ref = completion_logps(reference, prompt_ids, prompt_mask, completion_ids, completion_mask, TEMPERATURE)[0]
    torch.testing.assert_close(ours_ref, ref_logps, atol=1e-5, rtol=1e-5)
    batch = dict(prompt_ids=prompt_ids, prompt_mask=prompt_mask, completion_ids=completion_ids,
                 completion_mask=completion_mask, advantages=advantages, old_logps=old_logps, ref_logps=ours_ref)
    loss_sum, _ = objective.loss(model, batch)
    loss = loss_sum.sum / objective.count(batch)
    loss.backward()

    assert abs(loss.item() - expected.item()) < 1e-5
    for key in ("kl", "clip_ratio/low_mean", "clip_ratio/high_mean", "clip_ratio/region_mean", "entropy"):
        assert objective.stats[key] == pytest.approx(metrics[key], abs=1e-5), key
    assert metrics["clip_ratio/region_mean"] > 0  # the comparison covers clipped tokens
    theirs = {name: p.grad for name, p in trainer.model.named_parameters() if p.grad is not None}
    ours = _hf_grads(model)
    assert set(theirs) <= set(ours)
    for name, grad in theirs.items():
        torch.testing.assert_close(ours[name], grad, atol=1e-5, rtol=1e-4, msg=name)


def test_group_advantages_as_trl_normalises_them():
    from trl.trainer.utils import nanstd

    rewards = torch.tensor([1.0, 0.0, 0.5, 2.0, 2.0, 2.0, 3.0, float("nan"), 1.0])
    adv, zero = group_advantages(rewards, 3)
    grouped = rewards.view(-1, 3)
    want = (rewards - torch.nanmean(grouped, 1).repeat_interleave(3)) / (nanstd(grouped, 1).repeat_interleave(3) + 1e-4)
    torch.testing.assert_close(adv, torch.nan_to_num(want, nan=0.0))
    assert zero.tolist() == [False] * 3 + [True] * 3 + [False] * 3 and adv[3:6].abs().max() == 0
    batch, _ = group_advantages(rewards[:6], 3, "batch")
    torch.testing.assert_close(batch, (rewards[:6] - torch.nanmean(rewards[:6].view(-1, 3), 1).repeat_interleave(3))
                               / (nanstd(rewards[:6]) + 1e-4))
    none, _ = group_advantages(rewards[:3], 3, "none")
    torch.testing.assert_close(none, rewards[:3] - 0.5)
