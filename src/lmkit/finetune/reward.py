"""A Bradley-Terry reward model (`lmkit finetune --task reward`), as TRL's RewardTrainer trains it.

A causal LM's body with a scalar head `score` reads r(x, y) at the last token that is not padding (transformers'
...ForSequenceClassification pooling, num_labels=1). Per pair, with an optional margin m and TRL's
center_rewards_coefficient c (Ouyang et al. 2022, eq. 1; Touvron et al. 2023, eq. 2 for the margin; Eisenstein et
al. 2023 for centring):
    loss = -log sigmoid(r(x, y_w) - r(x, y_l) - m) + c ((r(x, y_w) + r(x, y_l))^2)
averaged over the step's pairs. Rows are tokenized as TRL does: prompt + completion as one text with EOS appended (or
the whole conversation through the chat template); pairs longer than max_length are dropped. The folder written is
transformers' GPT2ForSequenceClassification / LlamaForSequenceClassification / ... with num_labels=1.
"""
from __future__ import annotations

import json
import math
from dataclasses import asdict, dataclass

import torch
import torch.nn.functional as F
from torch import nn

from lmkit.atomic import atomic_write_json, staged_folder
from lmkit.device import to_device
from lmkit.errors import ConfigError, CorpusError
from lmkit.finetune.common import ShuffledEpochs, check_out, check_run, model_folder, peft_for_task, run_job, step_loop
from lmkit.finetune.dpo import PreferenceRun, disable_dropout
from lmkit.finetune.preference_data import read_preference_rows
from lmkit.finetune.sft import _with_template
from lmkit.objectives import LossSum
from lmkit.tokenizers import load_tokenizer
from lmkit.train.job import Job
from lmkit.train.optim import build_optimizer

MERGEABLE = ("full", "lora", "qlora", "ia3")


@dataclass
class RewardConfig(PreferenceRun):
    model: str
    train: str
    out: str
    center_rewards: float | None = None  # TRL's center_rewards_coefficient
    lr: float = 1e-4                     # TRL's RewardConfig default


class RewardModel(nn.Module):
    """r(ids) = score(h[last non-pad position]) over a causal LM's body `decoder` (its LM head unused)."""

    def __init__(self, lm: nn.Module, pad_id: int):
        super().__init__()
        self.decoder, self.config, self.pad_id = lm.decoder, lm.config, pad_id
        self.score = nn.Linear(lm.config.d_model, 1, bias=False)
        nn.init.normal_(self.score.weight, std=0.02)  # transformers' initializer_range

    def forward(self, input_ids: torch.Tensor, attention_mask: torch.Tensor | None = None) -> torch.Tensor:
        h = self.decoder(input_ids, attention_mask=attention_mask)
        if self.config.output_scale != 1.0:
            h = h * self.config.output_scale
        positions = torch.arange(input_ids.shape[1], device=input_ids.device)
        last = (positions * (input_ids != self.pad_id)).argmax(-1)  # the rightmost token that is not padding
        return self.score(h[torch.arange(len(h), device=h.device), last]).squeeze(-1).float()


def reward_pairs(tok, path, max_length: int, max_prompt_length: int | None = None) -> tuple[list[dict], dict]:
    """[{"chosen_ids", "rejected_ids"[, "margin"]}] as RewardTrainer tokenizes them; pairs past max_length dropped."""
    rows, kind = read_preference_rows(path)
    eos = tok.id_to_token(tok.eos_token_id) if tok.eos_token_id is not None else None
    with_margin = "margin" in rows[0][1]
    out, dropped = [], 0
    for line, row in rows:
        if ("margin" in row) != with_margin or (with_margin and not isinstance(row["margin"], (int, float))):
            raise CorpusError(f"{path}:{line}: give every row a numeric \"margin\", or none")
        if isinstance(row["chosen"], list):
            ids = [tok.apply_chat_template(row["prompt"] + row[k], return_dict=True)["input_ids"] for k in ("chosen", "rejected")]
            prompt = len(tok.apply_chat_template(row["prompt"], add_generation_prompt=True, return_dict=True)["input_ids"])
        else:
            ids = [tok.encode(row["prompt"] + (row[k] if row[k].endswith(eos or "") else row[k] + (eos or "")))
                   for k in ("chosen", "rejected")]
            prompt = len(tok.encode(row["prompt"])) if row["prompt"] else 0
        if max_prompt_length is not None and prompt > max_prompt_length:
            raise CorpusError(f"{path}:{line}: the prompt is {prompt} tokens, more than --max-prompt-length "
                              f"{max_prompt_length}; shorten it, drop the row or raise --max-prompt-length")
        if ids[0] == ids[1]:
            raise CorpusError(f"{path}:{line}: chosen and rejected give the same tokens; drop the row or give a "
                              "different rejected answer")
        if max(len(ids[0]), len(ids[1])) > max_length:
            dropped += 1
            continue
        out.append({"chosen_ids": ids[0], "rejected_ids": ids[1], **({"margin": float(row["margin"])} if with_margin else {})})
    if not out:
        raise CorpusError(f"{path}: every pair is longer than --max-length {max_length}; raise --max-length")
    return out, {"rows": len(rows), "pairs": len(out), "dropped": dropped, "format": kind}


def collate_rewards(pairs: list[dict], pad_id: int) -> dict[str, torch.Tensor]:
    """TRL's reward collator: the n chosen then the n rejected rows, right-padded; margins when given."""
    seqs = [p["chosen_ids"] for p in pairs] + [p["rejected_ids"] for p in pairs]
    T = max(len(s) for s in seqs)
    ids = torch.full((len(seqs), T), pad_id, dtype=torch.long)
    mask = torch.zeros((len(seqs), T), dtype=torch.long)
    for i, s in enumerate(seqs):
        ids[i, :len(s)], mask[i, :len(s)] = torch.tensor(s), 1
    batch = {"input_ids": ids, "attention_mask": mask}
    if "margin" in pairs[0]:
        batch["margin"] = torch.tensor([p["margin"] for p in pairs], dtype=torch.float32)
    return batch


class RewardObjective:
    """The mean Bradley-Terry loss over the step's pairs; keeps accuracy, margin and mean reward summed."""

    def __init__(self, center: float | None):
        self.center, self.sums = center, {"accuracy": 0.0, "margin": 0.0, "mean_reward": 0.0}

    def count(self, batch: dict) -> int:
        return batch["input_ids"].shape[0] // 2

    def loss(self, model: nn.Module, batch: dict) -> tuple[LossSum, None]:
        chosen, rejected = model(batch["input_ids"], attention_mask=batch["attention_mask"]).chunk(2)
        losses = -F.logsigmoid(chosen - rejected - batch["margin"] if "margin" in batch else chosen - rejected)
        if self.center is not None:
            losses = losses + self.center * (chosen + rejected) ** 2
        c, r = chosen.detach().double(), rejected.detach().double()
        self.sums["accuracy"] += float((c > r).sum())
        self.sums["margin"] += float((c - r).sum())
        self.sums["mean_reward"] += float((c + r).sum() / 2)
        return LossSum(losses.sum(), len(losses)), None

    def take(self, count: int) -> dict[str, float]:
        out = {k: v / max(count, 1) for k, v in self.sums.items()}
        self.sums = dict.fromkeys(self.sums, 0.0)
        return out


def save_reward_folder(model: RewardModel, tok, folder) -> None:
    """transformers' ...ForSequenceClassification folder: the body as the causal LM writes it, score.weight in
    place of the LM head, num_labels=1 and the pad id the pooling reads."""
    from safetensors.torch import load_file, save_file

    model.lm.save_pretrained(folder)  # the body, written by the causal LM that shares it
    weights = {k: v for k, v in load_file(str(folder / "model.safetensors")).items() if not k.startswith("lm_head")}
    weights["score.weight"] = model.score.weight.detach().cpu().contiguous()
    save_file(weights, str(folder / "model.safetensors"), metadata={"format": "pt"})
    config = json.loads((folder / "config.json").read_text(encoding="utf-8"))
    arch = config["architectures"][0]
    base = arch[: -len("LMHeadModel")] if arch.endswith("LMHeadModel") else arch[: -len("ForCausalLM")]
    config.update(architectures=[f"{base}ForSequenceClassification"], num_labels=1, id2label={"0": "LABEL_0"},
                  label2id={"LABEL_0": 0}, pad_token_id=model.pad_id)
    atomic_write_json(folder / "config.json", config, sort_keys=True)
    tok.save_pretrained(folder)


def load_reward_model(folder, device=None) -> RewardModel:
    """The RewardModel of a ...ForSequenceClassification folder with num_labels=1 (this job's, or transformers'):
    its body read by the causal-LM family through a staged copy whose config names the LM class."""
    import tempfile
    from pathlib import Path

    from safetensors.torch import load_file, save_file

    from lmkit.hub import load_model

    folder = Path(folder)
    try:
        config = json.loads((folder / "config.json").read_text(encoding="utf-8"))
        weights = load_file(str(folder / "model.safetensors"))
    except (OSError, ValueError) as exc:
        raise ConfigError(f"{folder} is not a reward model folder ({exc}); pass a folder from --task reward") from None
    arch = (config.get("architectures") or [""])[0]
    if not arch.endswith("ForSequenceClassification") or config.get("num_labels", len(config.get("id2label", {}))) != 1 \
            or "score.weight" not in weights:
        raise ConfigError(f"{folder} holds {arch or 'no architecture'}, not a reward model (...ForSequenceClassification "
                          "with num_labels=1 and a score head); pass a folder from --task reward")
    base = arch[: -len("ForSequenceClassification")]
    score = weights.pop("score.weight")
    embed = next(v for k, v in weights.items() if k.endswith(("wte.weight", "embed_tokens.weight")))
    weights["lm_head.weight"] = embed.clone()  # the LM head is unused; the causal class only needs one to load
    with tempfile.TemporaryDirectory() as tmp:
        config["architectures"] = ["GPT2LMHeadModel" if base == "GPT2" else f"{base}ForCausalLM"]
        for key in ("num_labels", "id2label", "label2id"):
            config.pop(key, None)
        (Path(tmp) / "config.json").write_text(json.dumps(config), encoding="utf-8")
        save_file(weights, str(Path(tmp) / "model.safetensors"), metadata={"format": "pt"})
        lm = load_model(tmp, device=device)
    pad = config.get("pad_token_id")
    model = RewardModel(lm, pad if pad is not None else config.get("eos_token_id", 0))
    with torch.no_grad():
        model.score.weight.copy_(score)
    object.__setattr__(model, "lm", lm)
    return model.eval().to(next(lm.parameters()).device)


def train_reward_model(config: RewardConfig, log=print) -> dict:
    """Train the reward model of config (see the module doc); the folder and reward.json in config.out."""
    return run_job(RewardJob, config, log)


class RewardJob(Job):
    """The reward model as a job of the one loop: shuffled pairs per step, the Bradley-Terry loss, the folder."""

    written_files = ("reward.json", "config.json", "model.safetensors", "tokenizer.json", "tokenizer_config.json")

    def __init__(self, c: RewardConfig, ctx):
        check_out(c.out, c.model)
        if c.peft not in MERGEABLE:
            raise ConfigError(f"--peft {c.peft} cannot be folded into the saved model; use one of {', '.join(MERGEABLE)}")
        if c.batch_size < 1 or c.batch_size % ctx.world_size:
            raise ConfigError(f"--batch-size {c.batch_size} must be a positive multiple of the {ctx.world_size} processes")
        self.precision = check_run(c.out, c.resume, c.save_every, c.precision, c.lr_schedule)
        lm, _ = model_folder(c.model, ctx.device)
        tok = load_tokenizer(c.model)
        _with_template(tok, c.chat_template, read_preference_rows(c.train)[1].endswith("conversational"), c.model)
        if tok.vocab_size > lm.config.vocab_size:
            raise ConfigError(f"the tokenizer has {tok.vocab_size} tokens, the model {lm.config.vocab_size}; a reward "
                              "model keeps the model's vocabulary: use a template without new tokens")
        max_length = c.max_length or min(lm.config.max_seq_len, 1024)
        self.train, self.report = reward_pairs(tok, c.train, max_length, c.max_prompt_length)
        self.held = reward_pairs(tok, c.eval, max_length, c.max_prompt_length)[0] if c.eval else None
        self.pad_id = tok.pad_token_id if tok.pad_token_id is not None else (tok.eos_token_id or 0)
        torch.manual_seed(c.seed)
        disable_dropout(lm)
        model = RewardModel(lm, self.pad_id).to(next(lm.parameters()).device)
        object.__setattr__(model, "lm", lm)  # kept for saving, not registered: its body is already `decoder`
        tuned = peft_for_task(model, c.peft, **c.peft_settings)
        if c.peft == "full":
            tuned.requires_grad_(True)
        self.c, self.ctx, self.tok, self.max_length, self.model, self.seed = c, ctx, tok, max_length, tuned, c.seed
        self.objective = RewardObjective(c.center_rewards)
        self.steps = c.max_steps or c.epochs * math.ceil(len(self.train) / c.batch_size)
        self.epochs = ShuffledEpochs(self.train, c.seed)
        self.before = self.after = None
        self.log, self.last = None, {}

    def run(self, log) -> dict:
        c = self.c
        loop = step_loop(self, c, self.steps, self.precision, self.ctx)
        if c.resume:
            loop.resume()
        else:
            self.before = self.evaluate(self.precision)
        self.log = log
        return loop.fit()

    def build_optimizer(self) -> torch.optim.Optimizer:
        return build_optimizer(self.model, self.c.lr, self.c.weight_decay, betas=(0.9, 0.999))

    def warmup(self, total_steps: int | None) -> int:
        return math.ceil(self.c.warmup_ratio * self.steps)

    def micro_batches(self, step: int, rank: int, world_size: int) -> list[dict]:
        parts = self.epochs.step(self.c.batch_size, self.c.micro_batch_size, rank, world_size)
        return [collate_rewards(part, self.pad_id) for part in parts]

    @torch.no_grad()
    def evaluate(self, precision: str) -> dict[str, float] | None:
        """Held-out loss and preference accuracy (r(chosen) > r(rejected)) over --eval's pairs."""
        if not self.held:
            return None
        was = self.model.training
        self.model.eval()
        objective, total = RewardObjective(self.c.center_rewards), 0.0
        device = next(self.model.parameters()).device
        for i in range(0, len(self.held), self.c.batch_size):
            batch = to_device(collate_rewards(self.held[i:i + self.c.batch_size], self.pad_id), device)
            total += float(objective.loss(self.model, batch)[0].sum)
        self.model.train(was)
        self.after = {"loss": total / len(self.held), **objective.take(len(self.held))}
        return self.after

    def state(self) -> dict:
        return {**self.epochs.state(), "before": self.before}

    def load_state(self, state: dict) -> None:
        self.epochs.load_state(state)
        self.before = state["before"]

    def step_row(self, loop, seconds: float, result: dict | None) -> dict:
        self.last = self.objective.take(loop.step_count)
        return {**self.last, **({f"eval_{k}": v for k, v in result.items()} if result else {})}

    def logged(self, loop, row: dict) -> None:
        if self.log is not None:
            self.log(f"step {row['step']}/{loop.total_steps or '?'}: loss {row['loss']:.4f}, accuracy {row['accuracy']:.3f}")

    def finish(self, loop) -> dict:
        c, tuned = self.c, self.model
        tuned.eval()
        final = tuned if c.peft == "full" else tuned.merge_and_unload()
        report = dict(self.report, steps=loop.step, last_loss=loop.last_loss, last_metrics=self.last,
                      eval_before=self.before, eval_after=self.after, seconds=round(loop.elapsed, 2),
                      precision=self.precision, config={k: v for k, v in asdict(c).items() if k != "peft_settings"})
        if self.ctx.is_main:
            with staged_folder(c.out) as folder:
                save_reward_folder(final, self.tok, folder)
                (folder / "reward.json").write_text(json.dumps(report, indent=2), encoding="utf-8")
        return report
