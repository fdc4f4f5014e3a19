"""Supervised fine-tuning of a causal LM on instruction data (`lmkit finetune --task sft`), with TRL's loss.

    loss of an optimizer step = sum over its micro-batches (and ranks) of -log p(label) / number of trained labels

a token-weighted mean: every trained token of the step counts once, however the step is cut into micro-batches.
Packed rows get a block-diagonal causal mask, so an example never attends to the one packed before it.
`--chat-template chatml` gives a model without a template ChatML: <|im_start|>/<|im_end|> become special tokens,
the embedding (and an untied head) grow by their rows, initialised to the mean of the old rows, and those rows
train even under LoRA (a gradient mask keeps the old rows fixed).
"""
from __future__ import annotations

import json
import math
from dataclasses import asdict, dataclass, field
from pathlib import Path

import torch
import torch.nn.functional as F
from torch import nn

from lmkit.atomic import staged_folder
from lmkit.chat_session import chat_generation_defaults
from lmkit.errors import ConfigError
from lmkit.device import module_device, resolve_device, to_device
from lmkit.finetune.common import ShuffledEpochs, check_out, check_run, default_lr, model_folder, peft_for_task
from lmkit.finetune.sft_data import SFTExample, prepare, read_rows, row_format
from lmkit.objectives import LossSum
from lmkit.tokenizers import load_tokenizer
from lmkit.train import distributed
from lmkit.train.distributed import all_reduce_sum
from lmkit.train.job import Job
from lmkit.train.loop import LoopSettings, TrainLoop
from lmkit.train.optim import build_optimizer

CHATML = ("{% for message in messages %}{{ '<|im_start|>' + message['role'] + '\n' }}"
          "{% if message['role'] == 'assistant' %}{% generation %}{{ message['content'] + '<|im_end|>' }}"
          "{% endgeneration %}{{ '\n' }}{% else %}{{ message['content'] + '<|im_end|>' + '\n' }}{% endif %}"
          "{% endfor %}{% if add_generation_prompt %}{{ '<|im_start|>assistant\n' }}{% endif %}")
CHATML_TOKENS = ("<|im_start|>", "<|im_end|>")
MERGEABLE = ("full", "lora", "qlora", "ia3")


@dataclass
class SFTConfig:
    model: str
    train: str
    out: str
    eval: str | None = None
    max_length: int | None = None      # default: the model's context, at most 1024 (TRL's default)
    packing: bool = False
    train_on_all: bool = False         # loss on every token, not only completions / assistant turns
    chat_template: str | None = None   # "chatml" or a .jinja file
    epochs: int = 1
    max_steps: int | None = None       # overrides epochs
    batch_size: int = 8                # examples (packed rows) per optimizer step
    micro_batch_size: int | None = None
    lr: float | None = None            # default: 1e-3 in full, 3e-3 for LoRA (lmkit.finetune.common.default_lr)
    warmup_ratio: float = 0.1
    weight_decay: float = 0.0
    seed: int = 0
    peft: str = "full"
    peft_settings: dict = field(default_factory=dict)
    log_every: int = 10
    time_budget: float | None = None   # seconds of training; the step count is planned from the first steps' speed
    precision: str | None = None       # fp32 | bf16 (autocast); None: bf16 where faster (fast_precision)
    lr_schedule: str = "cosine"        # after the warm-up: linear | cosine | constant, down to a tenth of --lr
    save_every: int | None = None      # a checkpoint every N steps (out/checkpoint), for resume
    resume: bool = False               # continue the run in out from its latest checkpoint
    device: str | None = None          # "auto", "cpu", "cuda[:N]", "mps"; None: the CPU (torchrun: the rank's GPU)


def collate(examples: list[SFTExample], pad_id: int) -> dict[str, torch.Tensor]:
    """Right-padded input_ids, labels (-100 on padding), position_ids restarting per packed example, and the
    attention mask: (B, T) for plain rows, or (B, 1, T, T) block-diagonal causal when a row packs several."""
    T = max(len(e.input_ids) for e in examples)
    B = len(examples)
    ids = torch.full((B, T), pad_id, dtype=torch.long)
    labels = torch.full((B, T), -100, dtype=torch.long)
    pos = torch.zeros((B, T), dtype=torch.long)
    seg = torch.full((B, T), -1, dtype=torch.long)
    for i, e in enumerate(examples):
        n = len(e.input_ids)
        ids[i, :n] = torch.tensor(e.input_ids)
        labels[i, :n] = torch.tensor(e.labels)
        pos[i, :n] = torch.tensor(e.position_ids())
        seg[i, :n] = torch.repeat_interleave(torch.arange(len(e.seq_lengths or [n])),
                                             torch.tensor(e.seq_lengths or [n]))
    batch = {"input_ids": ids, "labels": labels, "position_ids": pos}
    if any(len(e.seq_lengths) > 1 for e in examples):
        causal = torch.ones(T, T, dtype=torch.bool).tril()
        allowed = (seg[:, :, None] == seg[:, None, :]) & causal & (seg[:, None, :] >= 0)
        allowed |= torch.eye(T, dtype=torch.bool)  # padding attends to itself: no empty softmax rows
        batch["attention_mask"] = allowed[:, None]
    else:
        batch["attention_mask"] = (seg >= 0).long()
    return batch


def sft_loss(model: nn.Module, batch: dict) -> tuple[LossSum, torch.Tensor | None]:
    """(summed -log p of the trained labels and their number, the model's aux loss): labels[:, 1:] given inputs[:, :-1]."""
    batch = to_device(batch, module_device(model))  # evaluation's batches are made on the host
    out = model(batch["input_ids"], attention_mask=batch["attention_mask"], position_ids=batch["position_ids"])
    logits = out.logits[:, :-1].float()
    targets = batch["labels"][:, 1:]
    total = F.cross_entropy(logits.reshape(-1, logits.shape[-1]), targets.reshape(-1), ignore_index=-100,
                            reduction="sum")
    return LossSum(total, (targets != -100).sum()), getattr(out, "aux_loss", None)


def token_losses(model: nn.Module, batch: dict) -> tuple[torch.Tensor, torch.Tensor]:
    """(summed -log p of the trained labels, their number) of one batch."""
    loss, _ = sft_loss(model, batch)
    return loss.sum, loss.count


class SFTObjective:
    """TRL's SFT loss: -log p of the trained labels (completions / assistant turns), a mean over all of the step's."""

    def count(self, batch: dict) -> int:
        return int((batch["labels"][:, 1:] != -100).sum())

    loss = staticmethod(sft_loss)


def _all_sum(values: list[float], ctx) -> list[float]:
    """`values` summed over the ranks (float64, so counts stay exact); one process: as they are."""
    if ctx is None or ctx.world_size <= 1:
        return values

    return all_reduce_sum(torch.tensor(values, dtype=torch.float64), ctx).tolist()


@torch.no_grad()
def step_loss(model: nn.Module, micro_batches: list[dict], ctx=None) -> tuple[float, int]:
    """The loss the training loop gives one optimizer step over these micro-batches (this rank's; `ctx`:
    lmkit.train.distributed's): sum of -log p / N, with N the trained labels of all micro-batches and ranks.
    Returns (that mean, N)."""
    count = sum(SFTObjective().count(b) for b in micro_batches)
    n = max(int(_all_sum([float(count)], ctx)[0]), 1)
    total = sum(float(token_losses(model, b)[0]) for b in micro_batches)
    return _all_sum([total], ctx)[0] / n, n


@torch.no_grad()
def evaluate_loss(model: nn.Module, examples: list[SFTExample], pad_id: int, batch_size: int = 8, ctx=None) -> float:
    """Token-weighted mean loss (nats per trained label) over `examples`; under torchrun each rank scores every
    world_size-th batch and the sums are added up."""
    was = model.training
    model.eval()
    rank, world = (ctx.rank, ctx.world_size) if ctx is not None else (0, 1)
    total = count = 0.0
    for i in range(rank * batch_size, len(examples), world * batch_size):
        s, n = token_losses(model, collate(examples[i:i + batch_size], pad_id))
        total, count = total + float(s), count + int(n)
    model.train(was)
    total, count = _all_sum([total, count], ctx)
    return total / max(count, 1)


def resize_token_embeddings(model: nn.Module, size: int) -> list[int]:
    """Grow the token embedding (and an untied LM head) to `size` rows, new rows = mean of the old ones;
    returns the new row ids."""
    emb = model.get_input_embeddings()
    old = emb.weight.shape[0]
    if size <= old:
        return []
    tied = model.lm_head.weight is emb.weight
    new = nn.Embedding(size, emb.weight.shape[1], dtype=emb.weight.dtype)
    with torch.no_grad():
        new.weight[:old] = emb.weight
        new.weight[old:] = emb.weight.mean(0)
    model.decoder.embeddings.tokens = new
    if tied:
        model.lm_head = nn.Linear(new.weight.shape[1], size, bias=False)
        model.lm_head.weight = new.weight
    else:
        head = nn.Linear(model.lm_head.in_features, size, bias=False, dtype=model.lm_head.weight.dtype)
        with torch.no_grad():
            head.weight[:old] = model.lm_head.weight
            head.weight[old:] = model.lm_head.weight.mean(0)
        model.lm_head = head
    model.config.vocab_size = size
    return list(range(old, size))


def train_new_rows(model: nn.Module, rows: list[int]) -> None:
    """Let the embedding (and head) rows `rows` train while everything else keeps its requires_grad: the other rows
    of those matrices get zero gradient."""
    if not rows:
        return
    keep = torch.zeros(model.get_input_embeddings().weight.shape[0], 1)
    keep[rows] = 1.0
    for weight in {id(w): w for w in (model.get_input_embeddings().weight, model.lm_head.weight)}.values():
        if not weight.requires_grad:
            weight.requires_grad_(True)
            weight.register_hook(lambda g: g * keep.to(g.dtype))


def _with_template(tok, choice: str | None, needs: bool, model_dir) -> bool:
    """Give the tokenizer the template asked for; refuse conversations without one. True when tokens were added."""
    if choice is None:
        if needs and tok.chat_template is None:
            raise ConfigError(f"{model_dir} has no chat template, so its conversations cannot be rendered; pass "
                              "--chat-template chatml (adds <|im_start|>/<|im_end|>) or --chat-template FILE.jinja")
        return False
    if choice == "chatml":
        before = tok.vocab_size
        tok.add_special_tokens(list(CHATML_TOKENS))
        tok.chat_template = CHATML
        return tok.vocab_size > before
    path = Path(choice)
    if not path.is_file():
        raise ConfigError(f"--chat-template {choice}: no such file; give 'chatml' or a .jinja template file")
    tok.chat_template = path.read_text(encoding="utf-8")
    return False


def sft(config: SFTConfig, log=print) -> dict:
    """Fine-tune config.model on config.train (see the module doc); write the tuned model to config.out and return
    the report (also out/sft.json). metrics.jsonl grows as training goes; the model appears only when training
    finishes; with save_every, checkpoints from which `resume` continues a killed run with the same losses.

    Under torchrun (`torchrun --nproc-per-node N -m lmkit finetune --task sft ...`) every rank takes its share of
    each step's batch_size examples, DDP sums the gradients, and rank 0 writes the folder."""
    ctx = distributed.setup(None if config.device is None else resolve_device(config.device, "device="))
    with distributed.agree_on_setup(ctx):  # a rank failing alone (its own files) stops every rank
        job = SFTJob(config, ctx)
    report = job.run(log if ctx.is_main else None)
    if ctx.world_size > 1:
        torch.distributed.barrier()  # the folder is complete before any rank returns
    return report


class SFTJob(Job):
    """SFT as a job of the one loop: the shuffled examples of each step, the token-weighted loss, the merged model."""

    written_files = ("sft.json", "config.json", "model.safetensors", "tokenizer.json", "tokenizer_config.json")

    def __init__(self, c: SFTConfig, ctx):
        """Everything before the first step, with no collective: checks, model, tokenizer, data, PEFT."""
        check_out(c.out, c.model)
        if c.peft not in MERGEABLE:
            raise ConfigError(f"--peft {c.peft} cannot be folded into the saved model; use one of {', '.join(MERGEABLE)}")
        for flag, v in (("--batch-size", c.batch_size), ("--epochs", c.epochs), ("--micro-batch-size", c.micro_batch_size or 1)):
            if v < 1:
                raise ConfigError(f"{flag} must be at least 1, got {v}")
        if c.batch_size % ctx.world_size:
            raise ConfigError(f"--batch-size {c.batch_size} does not divide among the {ctx.world_size} processes; pick a "
                              f"multiple of {ctx.world_size}")
        self.precision = check_run(c.out, c.resume, c.save_every, c.precision, c.lr_schedule)
        model, _ = model_folder(c.model, ctx.device)
        tok = load_tokenizer(c.model)
        first = read_rows(c.train)[0]
        conversational = row_format(first[1], c.train) in ("messages", "conversational_prompt_completion")
        _with_template(tok, c.chat_template, conversational, c.model)
        max_length = c.max_length or min(model.config.max_seq_len, 1024)
        if max_length > model.config.max_seq_len:
            raise ConfigError(f"--max-length {max_length} is more than the model's {model.config.max_seq_len} positions")
        train, report = prepare(tok, c.train, max_length, c.train_on_all, c.packing)
        if len(train) < ctx.world_size:
            raise ConfigError(f"{c.train}: {len(train)} training examples for {ctx.world_size} processes; give at least "
                              "one example per process")
        self.held = prepare(tok, c.eval, max_length, c.train_on_all, False)[0] if c.eval else None
        self.pad_id = tok.pad_token_id if tok.pad_token_id is not None else (tok.eos_token_id or 0)
        torch.manual_seed(c.seed)
        self.new_rows = resize_token_embeddings(model, tok.vocab_size) if tok.vocab_size > model.config.vocab_size else []
        tuned = peft_for_task(model, c.peft, **c.peft_settings)
        if c.peft == "full":
            for p in tuned.parameters():
                p.requires_grad_(True)
        else:
            train_new_rows(model, self.new_rows)
        self.c, self.ctx, self.tok, self.train, self.report, self.max_length = c, ctx, tok, train, report, max_length
        self.model, self.seed, self.objective = tuned, c.seed, SFTObjective()
        self.lr = c.lr if c.lr is not None else default_lr(c.peft, "clm")
        self.steps = c.max_steps or c.epochs * math.ceil(len(train) / c.batch_size)
        self.epochs = ShuffledEpochs(self.train, c.seed)
        self.first_loss, self.before, self.after, self.log = None, None, None, None

    def run(self, log) -> dict:
        c = self.c
        settings = LoopSettings(lr=self.lr, max_steps=self.steps, time_budget=c.time_budget, min_lr=0.1 * self.lr,
                                lr_schedule=c.lr_schedule, grad_clip=1.0, precision=self.precision,
                                log_every=c.log_every, save_every=c.save_every, resume=c.resume)
        loop = TrainLoop(self, settings, c.out, self.ctx)  # DDP: its first broadcast is a collective
        if c.resume:
            loop.resume()
        else:
            if self.ctx.rank:
                torch.manual_seed(c.seed + self.ctx.rank)  # its own dropout masks; the batch order is rng's, shared
            self.before = evaluate_loss(self.model, self.held, self.pad_id, ctx=self.ctx) if self.held else None
        self.log = log
        return loop.fit()

    def build_optimizer(self) -> torch.optim.Optimizer:
        return build_optimizer(self.model, self.lr, self.c.weight_decay)

    def warmup(self, total_steps: int | None) -> int:
        return round(self.c.warmup_ratio * self.steps) if self.c.time_budget is None else 10

    def micro_batches(self, step: int, rank: int, world_size: int) -> list[dict[str, torch.Tensor]]:
        """The step's global batch (the same draw on every rank: epochs of shuffled examples), this rank's share."""
        parts = self.epochs.step(self.c.batch_size, self.c.micro_batch_size, rank, world_size)
        return [collate(part, self.pad_id) for part in parts]

    def evaluate(self, precision: str) -> dict[str, float] | None:
        self.after = evaluate_loss(self.model, self.held, self.pad_id, ctx=self.ctx) if self.held else None
        return None if self.after is None else {"loss": self.after}

    def state(self) -> dict:
        return {**self.epochs.state(), "first_loss": self.first_loss, "before": self.before}

    def load_state(self, state: dict) -> None:
        self.epochs.load_state(state)
        self.first_loss, self.before = state["first_loss"], state["before"]

    def checkpoint_info(self) -> dict:
        return {"sft_config": {k: v for k, v in asdict(self.c).items() if k != "resume"}}

    def step_row(self, loop, seconds: float, result: dict | None) -> dict:
        if self.first_loss is None:
            self.first_loss = loop.last_loss
        return {"tokens": loop.step_count}

    def logged(self, loop, row: dict) -> None:
        if self.log is not None:
            self.log(f"step {row['step']}/{loop.total_steps or '?'}: loss {row['loss']:.4f} over {row['tokens']} tokens")

    def finish(self, loop) -> dict:
        c, tuned = self.c, self.model
        tuned.eval()
        final = tuned if c.peft == "full" else tuned.merge_and_unload()
        report = self.report
        report.update(steps=loop.step, peft=c.peft, added_tokens=len(self.new_rows), max_length=self.max_length,
                      processes=self.ctx.world_size, first_loss=self.first_loss, last_loss=loop.last_loss,
                      eval_loss_before=self.before, eval_loss_after=self.after, seconds=round(loop.elapsed, 2),
                      precision=self.precision, config={k: v for k, v in asdict(c).items() if k != "peft_settings"})
        if self.ctx.is_main:
            if self.tok.chat_template is not None:  # every chat surface stops at the turn's end and samples alike
                final.generation_defaults = chat_generation_defaults(final, self.tok)
            with staged_folder(c.out) as folder:
                final.save_pretrained(folder)
                self.tok.save_pretrained(folder)
                (folder / "sft.json").write_text(json.dumps(report, indent=2), encoding="utf-8")
        return report
