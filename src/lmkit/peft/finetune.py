"""Fine-tuning loops shared by the PEFT methods (and by distillation): AdamW over the trainable
parameters only, linear warm-up then cosine decay, gradient clipping.

`train_causal_lm` minimises the mean next-token loss of rows from a packed stream (or a loss the
caller gives, e.g. distillation's), plus the model's mixture-of-experts auxiliary loss.
"""
from __future__ import annotations

import json
import math
import time
from pathlib import Path
from typing import Callable

import torch
import torch.nn.functional as F
from torch import nn

import lmkit
from lmkit.atomic import staged_folder
from lmkit.data import load_corpus
from lmkit.data.stream import PackedStream, eval_rows, tokenize_corpus
from lmkit.data.tokenize import special_ids
from lmkit.device import module_device, to_device
from lmkit.errors import CheckpointError, ConfigError, TrainingError
from lmkit.evaluate.perplexity import evaluate_rows
from lmkit.hub.files import atomic_write_json
from lmkit.objectives import next_token_targets, with_aux_loss
from lmkit.peft.model import METHODS, get_peft_model, trainable_summary
from lmkit.train.optim import build_optimizer, lr_at, set_lr


def next_token_loss_fn(model: nn.Module, inputs: torch.Tensor, targets: torch.Tensor) -> tuple[torch.Tensor, dict, object]:
    out = model(inputs)
    ce = F.cross_entropy(out.logits.reshape(-1, out.logits.shape[-1]).float(), targets.reshape(-1), ignore_index=-100)
    return ce, {"ce": ce}, out


def train_causal_lm(model: nn.Module, stream, pad_id: int, steps: int, batch_size: int, lr: float = 1e-3,
                    warmup_steps: int = 20, seed: int = 0, weight_decay: float = 0.0, grad_clip: float = 1.0,
                    loss_fn: Callable | None = None, log: Callable[[dict], None] | None = None) -> list[dict]:
    """Train `model` on `steps` batches of `stream.rows(seed, step, batch_size)`; the logged rows.

    loss_fn(model, inputs, targets) -> (loss, {name: value}, output); default: mean next-token CE.
    """
    loss_fn = loss_fn or next_token_loss_fn
    for flag, value in (("--max-steps", steps), ("--batch-size", batch_size)):
        if not isinstance(value, int) or value < 1:
            raise TrainingError(f"{flag} must be at least 1, got {value}")
    if not 0 < lr < math.inf:
        raise TrainingError(f"--lr must be a positive number, got {lr}")
    if not any(p.requires_grad for p in model.parameters()):
        raise TrainingError("the model has no trainable parameters; add a PEFT method or unfreeze some layers")
    opt = build_optimizer(model, lr, weight_decay)
    model.train()
    history, t0 = [], time.perf_counter()
    params = [p for p in model.parameters() if p.requires_grad]
    for step in range(steps):
        set_lr(opt, lr_at(step, lr, warmup_steps, steps, 0.1 * lr))
        rows = to_device(stream.rows(seed, step, batch_size), module_device(model))
        inputs, targets = next_token_targets(rows, (rows != pad_id).long())
        loss, parts, out = loss_fn(model, inputs, targets)
        total = with_aux_loss(loss, getattr(out, "aux_loss", None), model.config.router_aux_loss_coef)
        value = float(total.detach())
        if not math.isfinite(value):
            raise TrainingError(f"the loss became {value} at step {step + 1}; lower the learning rate (now {lr})")
        opt.zero_grad(set_to_none=True)
        total.backward()
        if grad_clip:
            torch.nn.utils.clip_grad_norm_(params, grad_clip)
        opt.step()
        row = {"step": step + 1, "loss": round(value, 5), **{k: round(float(v.detach()), 5) for k, v in parts.items()},
               "elapsed": round(time.perf_counter() - t0, 3)}
        history.append(row)
        if log is not None:
            log(row)
    model.eval()
    return history


@torch.no_grad()
def next_token_accuracy(model: nn.Module, rows: torch.Tensor, mask: torch.Tensor, batch_size: int = 16) -> float:
    """Share of scored positions whose argmax prediction is the next token (rows/mask from `eval_rows`)."""
    model.eval()
    right = total = 0
    device = module_device(model)
    for start in range(0, len(rows), batch_size):
        inputs, targets = next_token_targets(rows[start:start + batch_size].to(device),
                                             mask[start:start + batch_size].to(device))
        pred = model(inputs).logits.argmax(-1)
        keep = targets != -100
        right += int((pred[keep] == targets[keep]).sum())
        total += int(keep.sum())
    return right / max(total, 1)


class CausalLMData:
    """A corpus split into a packed training stream and validation rows, under a model's tokenizer."""

    def __init__(self, tokenizer, corpus, seq_len: int, max_val_docs: int | None = None, val_fraction: float = 0.05):
        self.tokenizer = tokenizer
        self.bos, self.pad = special_ids(tokenizer)
        train, val = load_corpus(corpus).split(val_fraction)
        self.stream = PackedStream(tokenize_corpus(train, tokenizer), self.bos, seq_len)
        self.val_rows, self.val_mask, self.val_bytes = eval_rows(tokenize_corpus(val, tokenizer), self.bos, self.pad,
                                                                 seq_len, max_val_docs)

    def evaluate(self, model: nn.Module, batch_size: int = 16) -> dict:
        """Validation loss (nats/token), perplexity, bits per byte and next-token accuracy."""
        r = evaluate_rows(model, self.val_rows, self.val_mask, self.val_bytes, batch_size=batch_size)
        r["accuracy"] = next_token_accuracy(model, self.val_rows, self.val_mask, batch_size)
        return r


def causal_lm_data(model: nn.Module, tokenizer, corpus, seq_len: int | None, max_val_docs: int | None = None,
                   method: str = "full", settings: dict | None = None, flag: str = "--seq-len",
                   val_fraction: float = 0.05) -> CausalLMData:
    """CausalLMData of `corpus` in rows that fit the model (`fitting_length`, at most 256 tokens by default)."""
    seq_len = fitting_length(model.config.max_seq_len, method, settings or {}, seq_len, 256, flag)
    return CausalLMData(tokenizer, list(corpus), seq_len, max_val_docs, val_fraction)


def check_out(out, source, flag: str = "--model") -> None:
    """Refuse an --out that is the input model folder (the new files would replace the model being read) or a file."""
    if out is None:
        return
    if Path(out).expanduser().resolve() == Path(source).expanduser().resolve():
        raise ConfigError(f"--out {out} is the {flag} folder and would overwrite it; write to another folder")
    if Path(out).exists() and not Path(out).is_dir():
        raise ConfigError(f"--out {out} is a file; give a folder to write the model in")


def model_folder(path, device=None):
    """(causal LM, tokenizer) of a folder that `lmkit train` wrote (tokenizer.json beside the weights); the model
    on `device` (None: the CPU)."""
    folder = Path(path)
    if not (folder / "tokenizer.json").is_file():
        raise CheckpointError(f"{folder} has no tokenizer.json; pass a folder written by `lmkit train` (or add one)")
    model = lmkit.load_model(folder, device=device)
    if type(model).__name__ != "CausalLM":
        arch = model.config.architecture
        raise ConfigError(f"{folder} holds a{'n' if arch.startswith('e') else ''} {arch} model; this command works on "
                          "causal language models (a folder from `lmkit train`, or GPT-2, LLaMA, Mixtral)")
    if model.config.compression.get("quantization"):  # int8 layers hold no trainable or prunable weights
        raise ConfigError(f"{folder} holds an int8-quantized model (from `lmkit quantize`); pass the float model "
                          "it was made from")
    return model, lmkit.load_tokenizer(folder / "tokenizer.json")


def save_model_folder(model: nn.Module, tokenizer, out, extra_json: dict | None = None) -> None:
    """The model (config.json + model.safetensors), its tokenizer.json and optional JSON files (`.jsonl`:
    a list of rows), staged beside `out` and moved in together, so an error or Ctrl-C changes nothing."""
    with staged_folder(out) as folder:
        model.save_pretrained(folder)
        tokenizer.save(str(folder / "tokenizer.json"))
        for name, obj in (extra_json or {}).items():
            if name.endswith(".jsonl"):
                (folder / name).write_text("".join(json.dumps(r) + "\n" for r in obj), encoding="utf-8")
            else:
                atomic_write_json(folder / name, obj)


TASK_HEADS = ("classifier", "qa_outputs", "score")  # task heads a PEFT method trains in full, as the PEFT library does


def peft_for_task(model: nn.Module, method: str, **settings):
    """get_peft_model with the model's task head (if any) in modules_to_save; method "full" changes nothing."""
    if method == "full":
        return model
    if "modules_to_save" not in settings:
        present = {name.rpartition(".")[2] for name, _ in model.named_modules()}
        settings["modules_to_save"] = [h for h in TASK_HEADS if h in present]
    return get_peft_model(model, method, **settings)


def fitting_length(max_seq_len: int, method: str, settings: dict, asked: int | None, cap: int,
                   flag: str = "--max-length") -> int:
    """Tokens per row that fit the model's positions once prompt tuning's virtual tokens (which take positions
    before every row) are counted: `asked`, or min(room, cap) when None; a ConfigError naming the largest
    `flag` value that fits when `asked` does not."""
    if asked is not None and asked < 1:
        raise ConfigError(f"{flag} must be at least 1, got {asked}")
    virtual = settings.get("num_virtual_tokens", 10) if method == "prompt" else 0
    room = max_seq_len - virtual
    if room < 1:
        raise ConfigError(f"{virtual} virtual tokens fill all {max_seq_len} positions of the model; use "
                          f"--virtual-tokens {max_seq_len - 1} or less")
    if asked is None:
        return min(room, cap)
    if asked > room:
        raise ConfigError(f"rows of {asked} tokens{f' after {virtual} virtual tokens' if virtual else ''} do not fit "
                          f"the model's {max_seq_len} positions; use {flag} {room} or less")
    return asked


def finetune_causal_lm_folder(model_dir, out, method: str = "lora", corpus=("pydocs",), steps: int = 100,
                              batch_size: int = 8, seq_len: int | None = None, lr: float | None = None, seed: int = 0,
                              max_val_docs: int | None = None, log=None, val_fraction: float = 0.05,
                              warmup_ratio: float | None = None, weight_decay: float = 0.0, device=None,
                              **settings) -> dict:
    """Fine-tune the causal LM of `model_dir` on `corpus` with a PEFT method (or "full"); write to `out`.

    Rows are `seq_len` tokens (default: what fits the model's context, at most 256); `val_fraction` of the
    corpus's documents (by `Corpus.split`) are held out for the scores before and after; `device` is where it
    trains (None: the CPU). The learning rate
    warms up over round(warmup_ratio * steps) steps (None: a tenth of them, at most 20), then decays by cosine.

    `out` gets the adapter in PEFT format (adapter_config.json + adapter_model.safetensors), or the whole
    model for "full", plus finetune.json with the validation scores before and after and the parameter counts.
    """
    check_out(out, model_dir)
    if not 0.0 < val_fraction < 1.0:
        raise TrainingError(f"--val-fraction must lie strictly between 0 and 1 (a share of the documents), got {val_fraction}")
    if warmup_ratio is not None and not 0.0 <= warmup_ratio <= 1.0:
        raise TrainingError(f"--warmup-ratio must lie in [0, 1] (a share of the steps), got {warmup_ratio}")
    if not 0.0 <= weight_decay < math.inf:
        raise TrainingError(f"--weight-decay must be a non-negative number, got {weight_decay}")
    model, tok = model_folder(model_dir, device)
    data = causal_lm_data(model, tok, corpus, seq_len, max_val_docs, method, settings, "--max-length", val_fraction)
    before = data.evaluate(model)
    torch.manual_seed(seed)
    tuned = peft_for_task(model, method, **settings)
    if method == "full":
        for p in tuned.parameters():
            p.requires_grad_(True)
    summary = trainable_summary(tuned)
    history = train_causal_lm(tuned, data.stream, data.pad, steps, batch_size, lr or default_lr(method, "clm"),
                              warmup_steps=min(20, steps // 10) if warmup_ratio is None else round(warmup_ratio * steps),
                              seed=seed, weight_decay=weight_decay, log=log)
    after = data.evaluate(tuned)
    report = {"method": method, "steps": steps, "seconds": history[-1]["elapsed"] if history else 0.0,
              **summary, "before": before, "after": after}
    if method == "full":
        save_model_folder(tuned, tok, out, {"finetune.json": report})
    else:
        with staged_folder(out) as folder:
            tuned.save_adapter(folder)
            atomic_write_json(folder / "finetune.json", report)
    return report


def add_peft_arguments(parser) -> None:
    """The --peft flags of `lmkit finetune` (argparse), shared by its classification and causal-LM paths."""
    g = parser.add_argument_group("parameter-efficient fine-tuning")
    g.add_argument("--peft", choices=("full",) + METHODS, default="full",
                   help="train everything (full, default) or only a PEFT method's parameters")
    g.add_argument("--lora-r", type=int, default=8, metavar="R", help="LoRA / QLoRA rank (default 8)")
    g.add_argument("--lora-alpha", type=float, default=16.0, help="LoRA scale alpha (update = alpha/r B A)")
    g.add_argument("--lora-dropout", type=float, default=0.0)
    g.add_argument("--target-modules", nargs="+", metavar="NAME",
                   help="layers LoRA/IA3 adapt, by name (q_proj v_proj, or the HF names; 're:REGEX' for a pattern)")
    g.add_argument("--qlora-bits", type=int, choices=(4, 8), default=4, help="QLoRA base weights: 4 (NF4) or 8 bits")
    g.add_argument("--virtual-tokens", type=int, default=16, metavar="N", help="prefix / prompt length")
    g.add_argument("--bottleneck", type=int, default=16, metavar="N", help="adapter bottleneck width")


def peft_settings(args) -> tuple[str, dict]:
    """(method, settings for peft_for_task) from the parsed --peft flags."""
    settings = dict(r=args.lora_r, alpha=args.lora_alpha, dropout=args.lora_dropout, bits=args.qlora_bits,
                    num_virtual_tokens=args.virtual_tokens, bottleneck=args.bottleneck)
    if args.target_modules:
        settings["target_modules"] = list(args.target_modules)
    return args.peft, settings


def default_lr(method: str, task: str = "clm") -> float:
    """Peak learning rates that suit each method (prompt-style methods train few, slow-moving parameters)."""
    if method == "full":
        return 3e-5 if task == "classify" else 1e-3
    return {"prompt": 1e-2, "prefix": 1e-2, "ia3": 1e-2}.get(method, 1e-3 if task == "classify" else 3e-3)
