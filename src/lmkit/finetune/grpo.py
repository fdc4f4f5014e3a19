"""GRPO (`lmkit finetune --task grpo`): reinforcement learning with verifiable rewards, as TRL's GRPOTrainer.

Each optimizer step takes batch_size / G prompts, samples G completions of each through the serving `Engine`
(continuous batching over a KV cache, every group's generator seeded from (seed, step, prompt)), scores them with
the reward function, turns the rewards into group-normalised advantages and takes one step on the loss of
`grpo_loss` (its formulas there). The completions are sampled by the weights being trained (TRL's
num_iterations=1), so the ratio is 1 in value and the clip acts through its gradient only; with num_iterations mu
each generation serves mu steps, the ratio against the log-probabilities it was sampled with. With beta > 0 a
frozen copy of the starting model is the reference of the KL term.
"""
from __future__ import annotations

import hashlib
import json
import math
import random
from dataclasses import asdict, dataclass

import torch

from lmkit.atomic import staged_folder
from lmkit.device import module_device, resolve_device, to_device
from lmkit.errors import ConfigError, RewardError
from lmkit.finetune.common import check_out, check_run, model_folder, step_loop
from lmkit.finetune.grpo_data import ADDITION_STOP, prompt_ids, read_prompts
from lmkit.finetune.grpo_loss import LOSS_TYPES, SCALE_REWARDS, GRPOObjective, completion_logps, group_advantages
from lmkit.finetune.rewards import checked, load_reward
from lmkit.tokenizers import load_tokenizer
from lmkit.train import distributed
from lmkit.train.job import Job
from lmkit.train.optim import build_optimizer


@dataclass
class GRPOConfig:
    """The settings of a run; the defaults are TRL GRPOConfig's (1.16) where TRL has the setting."""

    model: str
    prompts: str                        # a .jsonl file of {"prompt": ...} rows, or "addition-cot"
    reward: str                         # exact-answer | regex:PATTERN | MODULE:FUNCTION | a reward model folder
    out: str | None
    num_generations: int = 8            # G completions per prompt
    num_iterations: int = 1             # optimizer steps on each generation (DeepSeekMath's mu)
    batch_size: int = 16                # completions per step (TRL's per_device_train_batch_size): batch_size / G prompts
    max_steps: int | None = None        # default: one pass over the prompts
    beta: float = 0.0
    epsilon: float = 0.2
    epsilon_high: float | None = None   # None: epsilon
    temperature: float = 1.0
    top_p: float = 1.0
    top_k: int = 0                      # 0: off
    max_completion_length: int | None = None  # None: 512, or what fits the model's positions after the longest prompt
    max_prompt_length: int | None = None
    loss_type: str = "dapo"
    scale_rewards: str = "group"
    lr: float = 1e-6
    warmup_ratio: float = 0.0
    weight_decay: float = 0.0
    lr_schedule: str = "linear"
    seed: int = 0
    log_every: int = 1
    precision: str | None = None
    save_every: int | None = None
    resume: bool = False
    device: str | None = None


def group_seed(seed: int, step: int, index: int) -> int:
    """The seed of one prompt's group of completions at one step: the same on a rerun or a resume."""
    return int.from_bytes(hashlib.sha256(f"grpo-{seed}-{step}-{index}".encode()).digest()[:7], "big")


def grpo(config: GRPOConfig, log=print) -> dict:
    """Train config.model with GRPO (see the module doc); the tuned folder and grpo.json go to config.out."""
    ctx = distributed.setup(None if config.device is None else resolve_device(config.device, "device="))
    if ctx.world_size > 1:
        raise ConfigError("--task grpo runs in one process; start it without torchrun")
    job = GRPOJob(config, ctx)
    try:
        return job.run(log)
    finally:
        job.close()


class GRPOJob(Job):
    """GRPO as a job of the one loop: each step's rollouts and rewards become its one micro-batch."""

    written_files = ("grpo.json", "config.json", "model.safetensors", "tokenizer.json", "tokenizer_config.json",
                     "generation_config.json")

    def __init__(self, c: GRPOConfig, ctx):
        check_out(c.out, c.model)
        G = c.num_generations
        if G < 2:
            raise ConfigError(f"--num-generations must be at least 2 (advantages compare completions of one prompt), "
                              f"got {G}")
        if c.batch_size < G or c.batch_size % G:
            raise ConfigError(f"--batch-size {c.batch_size} (completions per step) must be a multiple of "
                              f"--num-generations {G}; use {max(G, c.batch_size // G * G)}")
        if c.loss_type not in LOSS_TYPES:
            raise ConfigError(f"--loss-type must be one of {', '.join(LOSS_TYPES)}, got {c.loss_type!r}")
        if c.scale_rewards not in SCALE_REWARDS:
            raise ConfigError(f"--scale-rewards must be one of {', '.join(SCALE_REWARDS)}, got {c.scale_rewards!r}")
        if c.num_iterations < 1:
            raise ConfigError(f"--num-iterations must be at least 1, got {c.num_iterations}")
        if c.max_steps is not None and c.max_steps < 1:
            raise ConfigError(f"--max-steps must be at least 1, got {c.max_steps}")
        if not c.temperature > 0 or not 0 < c.top_p <= 1 or c.top_k < 0 or c.epsilon < 0 or c.beta < 0:
            raise ConfigError("--temperature must be > 0, --top-p in (0, 1], --top-k, --epsilon and --beta >= 0")
        self.precision = check_run(c.out, c.resume, c.save_every, c.precision, c.lr_schedule)
        self.rows = read_prompts(c.prompts)
        if c.reward == "exact-answer" and "answer" not in self.rows[0]:
            raise ConfigError(f"--reward exact-answer compares with each row's \"answer\"; {c.prompts} has no such "
                              "column")
        model = model_folder(c.model, ctx.device)[0]
        tok = load_tokenizer(c.model)  # the folder: its chat template too
        self.ids = prompt_ids(tok, self.rows, c.prompts, c.max_prompt_length)
        room = model.config.max_seq_len - max(len(i) for i in self.ids)
        if c.max_completion_length is not None and c.max_completion_length > room:
            raise ConfigError(f"--max-completion-length {c.max_completion_length} does not fit the model's "
                              f"{model.config.max_seq_len} positions after the longest prompt; use {room} or less")
        if room < 1:
            raise ConfigError(f"the longest prompt fills the model's {model.config.max_seq_len} positions; set "
                              "--max-prompt-length to refuse it, or shorten it")
        self.max_len = c.max_completion_length or min(512, room)
        self.reference = None
        if c.beta != 0.0:  # the starting weights, frozen: the KL term's reference
            self.reference = model_folder(c.model, ctx.device)[0].eval().requires_grad_(False)
        self.reward = load_reward(c.reward)  # last: a worker process to stop if anything before failed
        self.c, self.ctx, self.tok, self.model, self.seed = c, ctx, tok, model.requires_grad_(True), c.seed
        self.pad_id = tok.pad_token_id if tok.pad_token_id is not None else (tok.eos_token_id or 0)
        self.objective = GRPOObjective(c.loss_type, c.beta, c.epsilon, c.epsilon_high, c.temperature, self.max_len)
        self.per_step = c.batch_size // G
        self.steps = c.max_steps or math.ceil(len(self.rows) / self.per_step)
        self.stop = list(ADDITION_STOP) if c.prompts == "addition-cot" else None
        self.stats: dict[str, float] = {}
        self.rewards_seen: list[float] = []
        self._epoch, self._order = -1, []  # the shuffled prompt order of the epoch last drawn from
        self._cached = None  # (generation, its batch, its stats)
        self.log = None

    def close(self) -> None:
        close = getattr(self.reward, "close", None)
        if close is not None:
            close()

    def run(self, log) -> dict:
        c = self.c
        loop = step_loop(self, c, self.steps, self.precision, self.ctx)
        if c.resume:
            loop.resume()
        self.log = log
        return loop.fit()

    def build_optimizer(self) -> torch.optim.Optimizer:
        return build_optimizer(self.model, self.c.lr, self.c.weight_decay, betas=(0.9, 0.999))

    def warmup(self, total_steps: int | None) -> int:
        return round(self.c.warmup_ratio * self.steps)

    # ---- one step's data: prompts, rollouts, rewards, advantages ------------------------------------------------
    def prompts_of(self, step: int) -> list[int]:
        """Row indices of step `step`: epochs of the prompts, each shuffled by (seed, epoch)."""
        out, n = [], len(self.rows)
        for k in range(step * self.per_step, (step + 1) * self.per_step):
            epoch = k // n
            if self._epoch != epoch:
                self._epoch, self._order = epoch, list(range(n))
                random.Random(f"grpo-order-{self.seed}-{epoch}").shuffle(self._order)
            out.append(self._order[k % n])
        return out

    def rollouts(self, step: int, picks: list[int]) -> list[list[int]]:
        """G sampled completions of each picked prompt (token ids, EOS kept), through one Engine run."""
        from lmkit.generation import GenerationConfig
        from lmkit.generation.engine import Engine, Request

        c, G = self.c, self.c.num_generations
        config = GenerationConfig(do_sample=True, temperature=c.temperature, top_p=c.top_p, top_k=c.top_k,
                                  repetition_penalty=1.0, max_new_tokens=self.max_len, stop_strings=self.stop)
        engine = Engine(self.model, max_batch=c.batch_size)  # new weights each step: a new engine
        requests = []
        for j, index in enumerate(picks):
            group = [Request(prompt=self.ids[index], config=config, seed=group_seed(c.seed, step, j),
                             tokenizer=self.tok) for _ in range(G)]
            requests += engine.prepare_group(group)
        engine.run_all(requests)
        self.model.train()
        return [r.output for r in requests]

    def rewards(self, picks: list[int], completions: list[list[int]]) -> torch.Tensor:
        """The reward of every completion (NaN: unscorable); a RewardError names the function and row."""
        G = self.c.num_generations
        rows = [self.rows[i] for i in picks for _ in range(G)]
        texts = [self.tok.decode(ids, skip_special_tokens=True) for ids in completions]
        if isinstance(rows[0]["prompt"], list):
            texts = [[{"role": "assistant", "content": t}] for t in texts]
        columns = {k: [r.get(k) for r in rows] for k in rows[0] if k != "prompt"}
        where = [f"completion {n % G} of prompt row {i + 1} of {self.c.prompts}" for n, i in
                 enumerate(p for p in picks for _ in range(G))]
        values = self.reward(prompts=[r["prompt"] for r in rows], completions=texts, completion_ids=completions,
                             **columns)
        return torch.tensor(checked(self.c.reward, values, len(rows), where), dtype=torch.float32)

    def micro_batches(self, step: int, rank: int, world_size: int) -> list[dict[str, torch.Tensor]]:
        """Generation `step // num_iterations`'s batch: sampled at its first step, reused by the next ones."""
        cycle = step // self.c.num_iterations
        if self._cached is None or self._cached[0] != cycle:
            batch = self.generation(cycle)
            self._cached = (cycle, batch, dict(self.stats))
        self.stats = dict(self._cached[2])
        return [self._cached[1]]

    def generation(self, cycle: int) -> dict[str, torch.Tensor]:
        """Rollouts of generation `cycle`, their rewards, advantages and reference log-probabilities; with
        num_iterations > 1 also the sampling policy's log-probabilities (pi_old of the ratio)."""
        picks = self.prompts_of(cycle)
        completions = self.rollouts(cycle, picks)
        try:
            rewards = self.rewards(picks, completions)
        except RewardError as exc:
            if self.c.out is None:
                raise
            self.loop.checkpoint()  # the weights and optimizer before this step: --resume starts it again
            raise RewardError(f"{exc}; the run's state is saved in {self.c.out}: fix the function and rerun with "
                              "--resume") from None
        advantages, zero_std = group_advantages(rewards, self.c.num_generations, self.c.scale_rewards)
        batch = self.collate([self.ids[i] for i in picks for _ in range(self.c.num_generations)], completions)
        batch["advantages"] = advantages
        batch = to_device(batch, module_device(self.model))  # the reference pass runs where the models are
        if self.reference is not None:
            with torch.no_grad():
                batch["ref_logps"] = completion_logps(self.reference, batch["prompt_ids"], batch["prompt_mask"],
                                                      batch["completion_ids"], batch["completion_mask"],
                                                      self.c.temperature)[0]
        if self.c.num_iterations > 1:
            with torch.no_grad():
                batch["old_logps"] = completion_logps(self.model, batch["prompt_ids"], batch["prompt_mask"],
                                                      batch["completion_ids"], batch["completion_mask"],
                                                      self.c.temperature)[0]
        lengths = [len(ids) for ids in completions]
        scored = rewards[~torch.isnan(rewards)]
        self.stats = {"reward": float(scored.mean()) if scored.numel() else math.nan,
                      "reward_std": float(scored.std()) if scored.numel() > 1 else 0.0,
                      "frac_reward_zero_std": float(zero_std.float().mean()),
                      "completions/mean_length": sum(lengths) / len(lengths),
                      "completions/clipped_ratio": sum(n >= self.max_len for n in lengths) / len(lengths)}
        return batch

    def collate(self, prompts: list[list[int]], completions: list[list[int]]) -> dict[str, torch.Tensor]:
        """Prompts left-padded and completions right-padded, with their masks (as TRL lays them out)."""
        P, C, B = max(map(len, prompts)), max(1, max(map(len, completions))), len(prompts)
        batch = {"prompt_ids": torch.full((B, P), self.pad_id), "prompt_mask": torch.zeros(B, P, dtype=torch.long),
                 "completion_ids": torch.full((B, C), self.pad_id),
                 "completion_mask": torch.zeros(B, C, dtype=torch.long)}
        for i, (p, o) in enumerate(zip(prompts, completions)):
            batch["prompt_ids"][i, P - len(p):] = torch.tensor(p)
            batch["prompt_mask"][i, P - len(p):] = 1
            if o:
                batch["completion_ids"][i, :len(o)] = torch.tensor(o)
                batch["completion_mask"][i, :len(o)] = 1
        return batch

    # ---- what the loop reports and keeps -------------------------------------------------------------------------
    def step_row(self, loop, seconds: float, result: dict | None) -> dict:
        self.rewards_seen.append(self.stats["reward"])
        return {**self.stats, **self.objective.stats, "tokens": loop.step_count}

    def logged(self, loop, row: dict) -> None:
        if self.log is not None:
            self.log(f"step {row['step']}/{loop.total_steps or '?'}: loss {row['loss']:.4f}, reward "
                     f"{row['reward']:.4f}, completion length {row['completions/mean_length']:.1f}")

    def postfix(self, row: dict, result: dict | None) -> dict[str, str]:
        return {"loss": f"{row['loss']:.3f}", "reward": f"{row['reward']:.3f}"}

    def state(self) -> dict:
        state = {"rewards_seen": self.rewards_seen}
        if self.c.num_iterations > 1 and self._cached is not None:  # a resume within a generation reuses it
            cycle, batch, stats = self._cached
            state["generation"] = {"cycle": cycle, "stats": stats,
                                   "batch": {k: [str(v.dtype), v.cpu().tolist()] for k, v in batch.items()}}
        return state

    def load_state(self, state: dict) -> None:
        self.rewards_seen = list(state.get("rewards_seen", []))
        saved = state.get("generation")
        if saved is not None:
            batch = {k: torch.tensor(values, dtype=getattr(torch, dtype.removeprefix("torch.")),
                                     device=module_device(self.model)) for k, (dtype, values) in saved["batch"].items()}
            self._cached = (saved["cycle"], batch, saved["stats"])

    def checkpoint_info(self) -> dict:
        return {"grpo_config": {k: v for k, v in asdict(self.c).items() if k != "resume"}}

    def finish(self, loop) -> dict:
        c = self.c
        self.model.eval()
        seen = [r for r in self.rewards_seen if not math.isnan(r)]
        report = {"steps": loop.step, "prompts": len(self.rows), "first_reward": seen[0] if seen else None,
                  "last_reward": seen[-1] if seen else None, "last_loss": loop.last_loss,
                  "max_completion_length": self.max_len, "seconds": round(loop.elapsed, 2),
                  "precision": self.precision, "config": asdict(c)}
        if c.out is not None:
            with staged_folder(c.out) as folder:  # moved in whole: a failed save leaves no half-written model
                self.model.save_pretrained(folder)
                self.tok.save_pretrained(folder)  # the chat template (tokenizer_config.json) too
                (folder / "grpo.json").write_text(json.dumps(report, indent=2), encoding="utf-8")
        return report
