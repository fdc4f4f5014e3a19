"""Direct preference optimization of a causal LM (`lmkit finetune --task dpo`), as TRL's DPOTrainer computes it.

With the policy's and the frozen reference's summed completion log-probabilities (finetune/logps.py) and
    d = (log pi(y_w|x) - log ref(y_w|x)) - (log pi(y_l|x) - log ref(y_l|x))
the per-pair losses (Rafailov et al. 2023 eq. 7; SLiC-HF, Zhao et al. 2023; IPO, Azar et al. 2024 eq. 17; robust
DPO, Chowdhury et al. 2024):
    sigmoid  -log sigmoid(beta d)
    hinge    max(0, 1 - beta d)                                             (SLiC)
    ipo      (d_w / |y_w| - d_l / |y_l| - 1 / (2 beta))^2                   per-token log-ratios, as TRL
    robust   (-(1 - e) log sigmoid(beta d) + e log sigmoid(-beta d)) / (1 - 2e),  e = --label-smoothing
and the step's loss is their mean over the step's pairs. The reference is --ref-model, else a frozen copy of the
starting model, or, under LoRA, the policy with its adapters disabled (no second copy); --precompute-ref scores the
data with it once and lets it go. metrics.jsonl carries TRL's names (rewards/chosen = beta (log pi - log ref) ...).
"""
from __future__ import annotations

import copy
import json
import math
from dataclasses import asdict, dataclass, field

import torch
import torch.nn.functional as F
from torch import nn

from lmkit.atomic import staged_folder
from lmkit.device import to_device
from lmkit.errors import ConfigError
from lmkit.finetune.common import ShuffledEpochs, check_out, check_run, model_folder, peft_for_task, run_job, step_loop
from lmkit.finetune.logps import completion_logps
from lmkit.finetune.preference_data import collate_pairs, prepare_pairs, read_preference_rows
from lmkit.finetune.sft import _with_template, resize_token_embeddings, train_new_rows
from lmkit.objectives import LossSum
from lmkit.peft.lora import adapters_disabled
from lmkit.tokenizers import load_tokenizer
from lmkit.train.distributed import all_reduce_sum
from lmkit.train.job import Job
from lmkit.train.optim import build_optimizer

LOSS_TYPES = ("sigmoid", "ipo", "hinge", "robust")
METRICS = ("rewards/chosen", "rewards/rejected", "rewards/accuracies", "rewards/margins", "logps/chosen",
           "logps/rejected")
MERGEABLE = ("full", "lora", "qlora", "ia3")


@dataclass(kw_only=True)
class PreferenceRun:
    """The settings of a job on preference pairs (DPO, the reward model), TRL's defaults; keyword-only, so each
    job's own fields come first."""
    eval: str | None = None
    max_length: int | None = None      # default: the model's context, at most 1024 (TRL's default)
    max_prompt_length: int | None = None
    chat_template: str | None = None
    epochs: int = 1
    max_steps: int | None = None
    batch_size: int = 8                # pairs per optimizer step (TRL's per_device_train_batch_size)
    micro_batch_size: int | None = None
    warmup_ratio: float = 0.0
    weight_decay: float = 0.0
    lr_schedule: str = "linear"
    seed: int = 0
    peft: str = "full"
    peft_settings: dict = field(default_factory=dict)
    log_every: int = 1
    precision: str | None = None
    save_every: int | None = None
    resume: bool = False
    device: str | None = None


@dataclass
class DPOConfig(PreferenceRun):
    model: str
    train: str
    out: str
    ref_model: str | None = None       # default: a frozen copy of --model (under LoRA: the adapters disabled)
    beta: float = 0.1
    loss_type: str = "sigmoid"
    label_smoothing: float = 0.0       # robust only, as in TRL
    precompute_ref: bool = False
    lr: float = 1e-6                   # TRL's DPOConfig default


def pair_losses(loss_type: str, beta: float, label_smoothing: float, chosen_logratios: torch.Tensor,
                rejected_logratios: torch.Tensor, completion_mask: torch.Tensor) -> torch.Tensor:
    """(n,) per-pair losses of the module doc from the log-ratios log pi - log ref of the n chosen and n rejected."""
    d = chosen_logratios - rejected_logratios
    if loss_type == "sigmoid":
        return -F.logsigmoid(beta * d)
    if loss_type == "hinge":
        return torch.relu(1 - beta * d)
    if loss_type == "ipo":
        n_chosen, n_rejected = completion_mask.sum(dim=1).clamp(min=1.0).chunk(2)
        return (chosen_logratios / n_chosen - rejected_logratios / n_rejected - 1 / (2 * beta)) ** 2
    if loss_type == "robust":
        e = label_smoothing
        return (-(1 - e) * F.logsigmoid(beta * d) + e * F.logsigmoid(-beta * d)) / (1 - 2 * e)
    raise ConfigError(f"--loss-type must be one of {', '.join(LOSS_TYPES)}, got {loss_type!r}")


def disable_dropout(model: nn.Module) -> None:
    """Dropout off in every layer, as TRL's disable_dropout_in_model (and attention's own rate)."""
    for m in model.modules():
        if isinstance(m, nn.Dropout):
            m.p = 0.0
        elif isinstance(getattr(m, "dropout", None), float):
            m.dropout = 0.0


class DPOObjective:
    """The mean DPO loss over the step's pairs; keeps the step's TRL metrics summed over its pairs."""

    def __init__(self, c: DPOConfig, reference):
        self.c, self.reference = c, reference   # reference(batch) -> (2n,) log-probabilities, no gradient
        self.sums = dict.fromkeys(METRICS, 0.0)

    def count(self, batch: dict) -> int:
        return batch["input_ids"].shape[0] // 2

    def ref_logps(self, batch: dict) -> tuple[torch.Tensor, torch.Tensor]:
        if "ref_chosen" in batch:
            return batch["ref_chosen"], batch["ref_rejected"]
        with torch.no_grad():
            return self.reference(batch).chunk(2)

    def loss(self, model: nn.Module, batch: dict) -> tuple[LossSum, None]:
        chosen, rejected = completion_logps(model, batch).chunk(2)
        ref_chosen, ref_rejected = self.ref_logps(batch)
        c = self.c
        chosen_ratio, rejected_ratio = chosen - ref_chosen, rejected - ref_rejected
        losses = pair_losses(c.loss_type, c.beta, c.label_smoothing, chosen_ratio, rejected_ratio,
                             batch["completion_mask"])
        self.add_metrics(c.beta * chosen_ratio.detach(), c.beta * rejected_ratio.detach(), chosen.detach(),
                         rejected.detach())
        return LossSum(losses.sum(), len(losses)), None

    def add_metrics(self, chosen_rewards, rejected_rewards, chosen, rejected) -> None:
        for key, v in zip(METRICS, (chosen_rewards, rejected_rewards, (chosen_rewards > rejected_rewards).float(),
                                    chosen_rewards - rejected_rewards, chosen, rejected)):
            self.sums[key] += float(v.double().sum())

    def take_metrics(self, count: int, ctx=None) -> dict[str, float]:
        """The step's metrics (means over its pairs, on every rank), and a fresh start for the next step."""
        sums = torch.tensor([self.sums[k] for k in METRICS], dtype=torch.float64)
        if ctx is not None and ctx.world_size > 1:
            sums = all_reduce_sum(sums, ctx)
        self.sums = dict.fromkeys(METRICS, 0.0)
        return {k: float(v) / max(count, 1) for k, v in zip(METRICS, sums.tolist())}


def dpo(config: DPOConfig, log=print) -> dict:
    """Train config.model by DPO on config.train (see the module doc); the tuned model and dpo.json in config.out."""
    return run_job(DPOJob, config, log)


def _check(c: DPOConfig, world_size: int) -> None:
    if c.loss_type not in LOSS_TYPES:
        raise ConfigError(f"--loss-type must be one of {', '.join(LOSS_TYPES)}, got {c.loss_type!r}")
    if c.beta <= 0:
        raise ConfigError(f"--beta must be positive, got {c.beta}")
    if c.label_smoothing and c.loss_type != "robust":
        raise ConfigError(f"--label-smoothing applies to --loss-type robust only (TRL's {c.loss_type} loss ignores "
                          "it); drop it or use --loss-type robust")
    if not 0.0 <= c.label_smoothing < 0.5:
        raise ConfigError(f"--label-smoothing is the share of flipped labels, in [0, 0.5), got {c.label_smoothing}")
    if c.peft not in MERGEABLE:
        raise ConfigError(f"--peft {c.peft} cannot be folded into the saved model; use one of {', '.join(MERGEABLE)}")
    for flag, v in (("--batch-size", c.batch_size), ("--epochs", c.epochs), ("--micro-batch-size", c.micro_batch_size or 1)):
        if v < 1:
            raise ConfigError(f"{flag} must be at least 1, got {v}")
    if c.batch_size % world_size:
        raise ConfigError(f"--batch-size {c.batch_size} does not divide among the {world_size} processes; pick a "
                          f"multiple of {world_size}")


class DPOJob(Job):
    """DPO as a job of the one loop: shuffled pairs per step, the DPO loss against the reference, the tuned model."""

    written_files = ("dpo.json", "config.json", "model.safetensors", "tokenizer.json", "tokenizer_config.json")

    def __init__(self, c: DPOConfig, ctx):
        check_out(c.out, c.model)
        _check(c, ctx.world_size)
        self.precision = check_run(c.out, c.resume, c.save_every, c.precision, c.lr_schedule)
        model, _ = model_folder(c.model, ctx.device)
        tok = load_tokenizer(c.model)
        _with_template(tok, c.chat_template, read_preference_rows(c.train)[1].endswith("conversational"), c.model)
        max_length = c.max_length or min(model.config.max_seq_len, 1024)
        if max_length > model.config.max_seq_len:
            raise ConfigError(f"--max-length {max_length} is more than the model's {model.config.max_seq_len} positions")
        self.train, self.report = prepare_pairs(tok, c.train, max_length, c.max_prompt_length)
        if len(self.train) < ctx.world_size:
            raise ConfigError(f"{c.train}: {len(self.train)} pairs for {ctx.world_size} processes; give at least one "
                              "pair per process")
        self.held = prepare_pairs(tok, c.eval, max_length, c.max_prompt_length)[0] if c.eval else None
        self.pad_id = tok.pad_token_id if tok.pad_token_id is not None else (tok.eos_token_id or 0)
        torch.manual_seed(c.seed)
        new_rows = resize_token_embeddings(model, tok.vocab_size) if tok.vocab_size > model.config.vocab_size else []
        disable_dropout(model)
        ref = self._reference(c, model, tok.vocab_size, ctx.device)
        tuned = peft_for_task(model, c.peft, **c.peft_settings)
        if c.peft == "full":
            for p in tuned.parameters():
                p.requires_grad_(True)
        else:
            train_new_rows(model, new_rows)
        self.c, self.ctx, self.tok, self.max_length, self.new_rows = c, ctx, tok, max_length, new_rows
        self.model, self.seed, self.ref = tuned, c.seed, ref
        self.objective = DPOObjective(c, self.reference_logps)
        self.steps = c.max_steps or c.epochs * math.ceil(len(self.train) / c.batch_size)
        self.epochs = ShuffledEpochs(self.train, c.seed)
        self.held_before = self.held_after = None
        self.log, self.last_metrics = None, {}

    @staticmethod
    def _reference(c: DPOConfig, model: nn.Module, vocab_size: int, device) -> nn.Module | None:
        """The frozen reference: --ref-model, a copy of the model, or None (LoRA: the policy with adapters off)."""
        if c.ref_model is not None:
            ref, _ = model_folder(c.ref_model, device)
            if ref.config.vocab_size < vocab_size:
                resize_token_embeddings(ref, vocab_size)
            if ref.config.vocab_size != vocab_size:
                raise ConfigError(f"--ref-model {c.ref_model} has {ref.config.vocab_size} tokens, the model "
                                  f"{vocab_size}; give a reference with the model's tokenizer")
        elif c.peft in ("lora", "qlora"):
            return None
        else:
            ref = copy.deepcopy(model)
        disable_dropout(ref)
        ref.eval().requires_grad_(False)
        return ref

    def reference_logps(self, batch: dict) -> torch.Tensor:
        if self.ref is not None:
            return completion_logps(self.ref, batch)
        with adapters_disabled(self.model):
            return completion_logps(self.model, batch)

    @torch.no_grad()
    def precompute(self) -> None:
        """Score every pair with the reference once (--precompute-ref) and let the reference go."""
        device = next(self.model.parameters()).device
        for pairs in (self.train, self.held or []):
            for i in range(0, len(pairs), self.c.batch_size):
                part = pairs[i:i + self.c.batch_size]
                logps = self.reference_logps(to_device(collate_pairs(part, self.pad_id, self.max_length), device))
                for p, rc, rr in zip(part, *logps.chunk(2)):
                    p.ref_chosen, p.ref_rejected = float(rc), float(rr)
        self.ref = None

    def run(self, log) -> dict:
        c = self.c
        loop = step_loop(self, c, self.steps, self.precision, self.ctx)
        if c.precompute_ref:
            self.precompute()
        if c.resume:
            loop.resume()
        else:
            self.held_before = self.evaluate(self.precision)
        self.log = log
        return loop.fit()

    def build_optimizer(self) -> torch.optim.Optimizer:
        return build_optimizer(self.model, self.c.lr, self.c.weight_decay, betas=(0.9, 0.999))  # TRL's AdamW

    def warmup(self, total_steps: int | None) -> int:
        return math.ceil(self.c.warmup_ratio * self.steps)  # transformers' get_warmup_steps

    def micro_batches(self, step: int, rank: int, world_size: int) -> list[dict[str, torch.Tensor]]:
        """The step's pairs (the same draw on every rank: epochs of shuffled pairs), this rank's share."""
        parts = self.epochs.step(self.c.batch_size, self.c.micro_batch_size, rank, world_size)
        return [collate_pairs(part, self.pad_id, self.max_length) for part in parts]

    @torch.no_grad()
    def evaluate(self, precision: str) -> dict[str, float] | None:
        """Held-out loss, preference accuracy (implicit reward margin > 0) and mean margin over --eval's pairs."""
        if not self.held:
            return None
        was = self.model.training
        self.model.eval()
        objective, total = DPOObjective(self.c, self.reference_logps), 0.0
        device = next(self.model.parameters()).device
        for i in range(0, len(self.held), self.c.batch_size):
            batch = to_device(collate_pairs(self.held[i:i + self.c.batch_size], self.pad_id, self.max_length), device)
            total += float(objective.loss(self.model, batch)[0].sum)
        self.model.train(was)
        scores = objective.take_metrics(len(self.held))
        self.held_after = {"loss": total / len(self.held), "accuracy": scores["rewards/accuracies"],
                           "margin": scores["rewards/margins"]}
        return self.held_after

    def state(self) -> dict:
        return {**self.epochs.state(), "held_before": self.held_before}

    def load_state(self, state: dict) -> None:
        self.epochs.load_state(state)
        self.held_before = state["held_before"]

    def checkpoint_info(self) -> dict:
        return {"dpo_config": {k: v for k, v in asdict(self.c).items() if k != "resume"}}

    def step_row(self, loop, seconds: float, result: dict | None) -> dict:
        self.last_metrics = self.objective.take_metrics(loop.step_count, self.ctx)
        row = dict(self.last_metrics)
        if result is not None:
            row.update({f"eval_{k}": v for k, v in result.items()})
        return row

    def logged(self, loop, row: dict) -> None:
        if self.log is not None:
            self.log(f"step {row['step']}/{loop.total_steps or '?'}: loss {row['loss']:.4f}, reward accuracy "
                     f"{row['rewards/accuracies']:.3f}, margin {row['rewards/margins']:.4f}")

    def finish(self, loop) -> dict:
        c, tuned = self.c, self.model
        tuned.eval()
        final = tuned if c.peft == "full" else tuned.merge_and_unload()
        report = dict(self.report, steps=loop.step, peft=c.peft, max_length=self.max_length,
                      processes=self.ctx.world_size, last_loss=loop.last_loss, last_metrics=self.last_metrics,
                      eval_before=self.held_before, eval_after=self.held_after, seconds=round(loop.elapsed, 2),
                      precision=self.precision, config={k: v for k, v in asdict(c).items() if k != "peft_settings"})
        if self.ctx.is_main:
            with staged_folder(c.out) as folder:
                final.save_pretrained(folder)
                self.tok.save_pretrained(folder)
                (folder / "dpo.json").write_text(json.dumps(report, indent=2), encoding="utf-8")
        return report
