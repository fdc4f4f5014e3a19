"""A GRPO step whose groups all agree (every advantage 0, so a zero gradient) still steps AdamW, in lmkit as in TRL's
GRPOTrainer (transformers' Trainer calls optimizer.step() every step): the moments of the rewarded step before it
move every weight again, by lr_2 * m_hat_2 / sqrt(v_hat_2) = (lr_2 / lr_1) * [b1 (1 - b1) / (1 - b1^2)] /
sqrt(b2 (1 - b2) / (1 - b2^2)) times the first step's move, the same on both sides."""
from __future__ import annotations

import math

import pytest
import torch

from helpers.hf_folders import build
from lmkit.finetune.grpo import GRPOConfig, GRPOJob
from lmkit.train import distributed

transformers = pytest.importorskip("transformers")
trl = pytest.importorskip("trl")
datasets = pytest.importorskip("datasets")

LR, BETAS = 1e-3, (0.9, 0.999)


def mixed_then_agreeing():
    """A reward function: mixed rewards at its first call (one generation), all 0.0 after."""
    calls = []

    def reward(prompts, completions, **_):
        calls.append(1)
        return [float(i % 2) for i in range(len(completions))] if len(calls) == 1 else [0.0] * len(completions)
    return reward


def expected_ratio() -> float:
    """The second step's move over the first's for a weight with one gradient g then 0, at lr_2 = lr_1 / 2
    (the linear schedule over 2 steps): the first move is lr_1 sign(g), the second lr_2 m_hat_2 / sqrt(v_hat_2)."""
    b1, b2 = BETAS
    return 0.5 * (b1 * (1 - b1) / (1 - b1 ** 2)) / math.sqrt(b2 * (1 - b2) / (1 - b2 ** 2))


def moves(snapshots: list[dict[str, torch.Tensor]]) -> tuple[torch.Tensor, torch.Tensor]:
    """Every weight's move at step 1 and at step 2, flattened."""
    first = torch.cat([(snapshots[1][k] - snapshots[0][k]).flatten() for k in snapshots[0]])
    second = torch.cat([(snapshots[2][k] - snapshots[1][k]).flatten() for k in snapshots[0]])
    return first, second


def trl_moves(folder: str, tmp_path) -> tuple[torch.Tensor, torch.Tensor]:
    args = trl.GRPOConfig(output_dir=str(tmp_path / "trl"), num_generations=3, per_device_train_batch_size=6,
                          learning_rate=LR, max_steps=2, max_completion_length=6, report_to=[], use_cpu=True,
                          bf16=False, disable_dropout=True, logging_steps=1, save_strategy="no")
    data = datasets.Dataset.from_list([{"prompt": p} for p in ("hello world", "The fox")] * 3)
    trainer = trl.GRPOTrainer(model=folder, reward_funcs=mixed_then_agreeing(), args=args, train_dataset=data,
                              processing_class=transformers.AutoTokenizer.from_pretrained(folder))
    snapshots = [{k: v.detach().clone() for k, v in trainer.model.named_parameters()}]

    class Snapshot(transformers.TrainerCallback):
        def on_step_end(self, *_, **__):
            snapshots.append({k: v.detach().clone() for k, v in trainer.model.named_parameters()})

    trainer.add_callback(Snapshot())
    trainer.train()
    grad_norms = [row["grad_norm"] for row in trainer.state.log_history if "grad_norm" in row]
    assert grad_norms[0] > 0 and grad_norms[1] == 0  # the second step's gradient is exactly zero
    return moves(snapshots)


def lmkit_moves(folder: str) -> tuple[torch.Tensor, torch.Tensor]:
    job = GRPOJob(GRPOConfig(model=folder, prompts="addition-cot", reward="exact-answer", out=None, num_generations=3,
                             batch_size=6, max_steps=2, max_completion_length=6, lr=LR, precision="fp32"),
                  distributed.setup(None))
    job.reward = mixed_then_agreeing()
    snapshots = [{k: v.detach().clone() for k, v in job.model.named_parameters()}]
    row_of = job.step_row

    def step_row(loop, seconds, result):
        snapshots.append({k: v.detach().clone() for k, v in job.model.named_parameters()})
        return {**row_of(loop, seconds, result), "grad_norm_seen": loop.grad_norm}

    job.step_row = step_row
    grad_norms = []
    job.logged = lambda loop, row: grad_norms.append(row["grad_norm"])
    job.run(log=None)
    job.close()
    assert grad_norms[0] > 0 and grad_norms[1] == 0
    return moves(snapshots)


def test_a_step_with_every_advantage_zero_moves_the_weights_as_trl_does(tmp_path):
    folder = build("llama", tmp_path / "llama")
    ratio = expected_ratio()
    for first, second in (trl_moves(folder, tmp_path), lmkit_moves(folder)):
        assert second.abs().max() > 0  # the zero-gradient step moved the weights
        sign_like = first.abs() > 0.999 * LR  # |g| > 1000 AdamW eps: a first move of lr sign(g)
        assert sign_like.float().mean() > 0.5
        torch.testing.assert_close(second[sign_like] / first[sign_like],
                                   torch.full((int(sign_like.sum()),), ratio), atol=2e-3, rtol=2e-3)
