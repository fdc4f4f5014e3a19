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
import random
import time
from dataclasses import asdict, dataclass, field
from pathlib import Path

import torch
import torch.nn.functional as F
from torch import nn

import lmkit
from lmkit.atomic import staged_folder
from lmkit.device import module_device, resolve_device, to_device
from lmkit.errors import ConfigError, TrainingError
from lmkit.finetune.sft_data import SFTExample, prepare, read_rows, row_format
from lmkit.peft.finetune import check_out, default_lr, model_folder, peft_for_task
from lmkit.train import distributed
from lmkit.train.distributed import all_reduce_sum, broadcast_float, no_sync
from lmkit.train.optim import build_optimizer, lr_at, set_lr

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
    lr: float | None = None            # default: 1e-3 in full, 3e-3 for LoRA (lmkit.peft.finetune.default_lr)
    warmup_ratio: float = 0.1
    weight_decay: float = 0.0
    seed: int = 0
    peft: str = "full"
    peft_settings: dict = field(default_factory=dict)
    log_every: int = 10
    time_budget: float | None = None   # seconds of training; the step count is planned from the first steps' speed
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


def token_losses(model: nn.Module, batch: dict) -> tuple[torch.Tensor, torch.Tensor]:
    """(summed -log p of the trained labels, their number) of one batch: labels[:, 1:] given inputs[:, :-1]."""
    device = module_device(model)
    batch = {k: to_device(v, device) for k, v in batch.items()}
    out = model(batch["input_ids"], attention_mask=batch["attention_mask"], position_ids=batch["position_ids"])
    logits = out.logits[:, :-1].float()
    targets = batch["labels"][:, 1:]
    total = F.cross_entropy(logits.reshape(-1, logits.shape[-1]), targets.reshape(-1), ignore_index=-100,
                            reduction="sum")
    return total, (targets != -100).sum()


def _all_sum(values: list[float], ctx) -> list[float]:
    """`values` summed over the ranks (float64, so counts stay exact); one process: as they are."""
    if ctx is None or ctx.world_size <= 1:
        return values

    return all_reduce_sum(torch.tensor(values, dtype=torch.float64), ctx).tolist()


def step_loss(model: nn.Module, micro_batches: list[dict], backward: bool = True, ctx=None) -> tuple[float, int]:
    """Run this rank's micro-batches of one optimizer step, backpropagating sum / N with N the step's trained labels
    over all micro-batches and all ranks (`ctx`: lmkit.train.distributed's; DDP must then *sum* the ranks'
    gradients, as `wrap_model` sets it up). Returns (the step's mean loss over every rank, N)."""

    count = sum(int((b["labels"][:, 1:] != -100).sum()) for b in micro_batches)
    n = max(int(_all_sum([float(count)], ctx)[0]), 1)
    total = 0.0
    for i, b in enumerate(micro_batches):
        with no_sync(model, backward and i < len(micro_batches) - 1):  # one all-reduce per step, after the last
            summed, _ = token_losses(model, b)
            if backward:
                (summed / n).backward()
        total += float(summed.detach())
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
    the report (also out/sft.json). Nothing is written to out unless training finishes.

    Under torchrun (`torchrun --nproc-per-node N -m lmkit finetune --task sft ...`) every rank takes its share of
    each step's batch_size examples, DDP sums the gradients, and rank 0 writes the folder."""
    ctx = distributed.setup(None if config.device is None else resolve_device(config.device, "device="))
    with distributed.agree_on_setup(ctx):  # a rank failing alone (its own files) stops every rank
        run = _set_up(config, ctx)
    run["engine"] = distributed.wrap_model(run["tuned"], ctx)  # DDP: its first broadcast is a collective
    report = _train(config, run, ctx, log if ctx.is_main else None)
    if ctx.is_main:
        _save(run["final"], run["tok"], config.out, report, run["history"])
    if ctx.world_size > 1:
        import torch.distributed as dist

        dist.barrier()  # the folder is complete before any rank returns
    return report


def _set_up(c: SFTConfig, ctx) -> dict:
    """Everything before the first step, with no collective: checks, model, tokenizer, data, PEFT, optimizer."""
    check_out(c.out, c.model)
    if c.peft not in MERGEABLE:
        raise ConfigError(f"--peft {c.peft} cannot be folded into the saved model; use one of {', '.join(MERGEABLE)}")
    for flag, v in (("--batch-size", c.batch_size), ("--epochs", c.epochs), ("--micro-batch-size", c.micro_batch_size or 1)):
        if v < 1:
            raise ConfigError(f"{flag} must be at least 1, got {v}")
    if c.batch_size % ctx.world_size:
        raise ConfigError(f"--batch-size {c.batch_size} does not divide among the {ctx.world_size} processes; pick a "
                          f"multiple of {ctx.world_size}")
    model, _ = model_folder(c.model, ctx.device)
    tok = lmkit.load_tokenizer(c.model)
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
    held = prepare(tok, c.eval, max_length, c.train_on_all, False)[0] if c.eval else None
    pad_id = tok.pad_token_id if tok.pad_token_id is not None else (tok.eos_token_id or 0)
    torch.manual_seed(c.seed)
    new_rows = resize_token_embeddings(model, tok.vocab_size) if tok.vocab_size > model.config.vocab_size else []
    tuned = peft_for_task(model, c.peft, **c.peft_settings)
    if c.peft == "full":
        for p in tuned.parameters():
            p.requires_grad_(True)
    else:
        train_new_rows(model, new_rows)
    lr = c.lr if c.lr is not None else default_lr(c.peft, "clm")
    return dict(model=model, tok=tok, train=train, held=held, report=report, pad_id=pad_id, tuned=tuned,
                new_rows=new_rows, lr=lr, max_length=max_length,
                opt=build_optimizer(tuned, lr, c.weight_decay))


def _train(c: SFTConfig, run: dict, ctx, log) -> dict:
    """The optimizer steps; fills run["history"] (one row per step) and run["final"] (the merged model)."""

    train, tuned, engine, opt, lr, pad_id = (run[k] for k in ("train", "tuned", "engine", "opt", "lr", "pad_id"))
    before = evaluate_loss(tuned, run["held"], pad_id, ctx=ctx) if run["held"] else None
    micro = c.micro_batch_size or c.batch_size
    steps = c.max_steps or c.epochs * math.ceil(len(train) / c.batch_size)
    warmup = round(c.warmup_ratio * steps) if c.time_budget is None else 10
    params = [p for p in tuned.parameters() if p.requires_grad]
    rng, order, history, t0 = random.Random(c.seed), [], [], time.perf_counter()
    if ctx.rank:
        torch.manual_seed(c.seed + ctx.rank)  # its own dropout masks; the batch order stays rng's, shared by all ranks
    tuned.train()
    step = 0
    while step < steps:
        batch = []  # the step's global batch: the same draw on every rank
        while len(batch) < min(c.batch_size, len(train)):
            if not order:
                order = list(range(len(train)))
                rng.shuffle(order)
            batch.append(train[order.pop()])
        mine = batch[ctx.rank * len(batch) // ctx.world_size:(ctx.rank + 1) * len(batch) // ctx.world_size]
        set_lr(opt, lr_at(step, lr, warmup, steps, 0.1 * lr))
        opt.zero_grad(set_to_none=True)
        loss, n = step_loss(engine, [collate(mine[i:i + micro], pad_id) for i in range(0, len(mine), micro)], ctx=ctx)
        if not math.isfinite(loss):
            raise TrainingError(f"the loss became {loss} at step {step + 1}; lower --lr (now {lr})")
        grad_norm = float(torch.nn.utils.clip_grad_norm_(params, 1.0))
        opt.step()
        elapsed = time.perf_counter() - t0
        history.append({"step": step + 1, "loss": round(loss, 7), "grad_norm": grad_norm, "tokens": n,
                        "elapsed": round(elapsed, 3)})
        if c.time_budget is not None and step + 1 in (5, 20, 50) and step + 1 < steps:
            planned = max(step + 2, min(steps, int(c.time_budget / (elapsed / (step + 1)))))  # the budget's steps
            steps = int(broadcast_float(planned, ctx))  # rank 0's clock decides for every rank
        if log is not None and ((step + 1) % c.log_every == 0 or step + 1 == steps):
            log(f"step {step + 1}/{steps}: loss {loss:.4f} over {n} tokens")
        step += 1
    tuned.eval()
    after = evaluate_loss(tuned, run["held"], pad_id, ctx=ctx) if run["held"] else None
    run["final"] = tuned if c.peft == "full" else tuned.merge_and_unload()
    run["history"] = history
    report = run["report"]
    report.update(steps=len(history), peft=c.peft, added_tokens=len(run["new_rows"]), max_length=run["max_length"],
                  processes=ctx.world_size, first_loss=history[0]["loss"], last_loss=history[-1]["loss"],
                  eval_loss_before=before, eval_loss_after=after, seconds=round(time.perf_counter() - t0, 2),
                  config={k: v for k, v in asdict(c).items() if k != "peft_settings"})
    return report


def _save(model: nn.Module, tok, out, report: dict, history: list[dict]) -> None:
    with staged_folder(out) as folder:
        model.save_pretrained(folder)
        tok.save_pretrained(folder)
        (folder / "sft.json").write_text(json.dumps(report, indent=2), encoding="utf-8")
        (folder / "metrics.jsonl").write_text("".join(json.dumps(r) + "\n" for r in history), encoding="utf-8")
