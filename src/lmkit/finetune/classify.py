"""Fine-tune a pretrained encoder for text classification: a fresh classification head on [CLS] (or mean)
pooling, AdamW with linear warm-up then linear decay, a few epochs, accuracy and macro-F1 on held-out
data after each epoch, and the best checkpoint (by macro-F1, then accuracy) saved as a model folder.

The out folder holds config.json + model.safetensors (a ...ForSequenceClassification that transformers
loads, id2label included), the tokenizer as `transformers.AutoTokenizer` reads it (tokenizer.json,
tokenizer_config.json, special_tokens_map.json), and metrics.jsonl (one line per epoch).
"""
from __future__ import annotations

import json
import math
import random
import shutil
import sys
import tempfile
import time
from dataclasses import asdict, dataclass, replace
from pathlib import Path

import torch

from lmkit.atomic import atomic_write_bytes
from lmkit.config_sections import UNSET
from lmkit.device import module_device, resolve_device, to_device
from lmkit.errors import ConfigError, CorpusError
from lmkit.finetune.data import Example, label_names, read_examples, split_examples
from lmkit.finetune.metrics import accuracy, macro_f1
from lmkit.hub import load_model
from lmkit.models.encoder import Encoder
from lmkit.models.xlnet import XLNet
from lmkit.objectives import with_aux_loss
from lmkit.peft.finetune import check_out, fitting_length, peft_for_task
from lmkit.progress import progress_bar
from lmkit.tokenizers import load_tokenizer


@dataclass
class FinetuneConfig:
    model: str                      # a pretrained encoder folder (with tokenizer.json)
    train: str                      # CSV or JSONL: text, optional text_pair, label
    out: str
    eval: str | None = None         # None: hold out val_fraction of train
    epochs: int = 3
    lr: float = 3e-5
    batch_size: int = 16
    max_length: int | None = None  # None: 128, or less when the model has fewer positions
    warmup_ratio: float = 0.1
    weight_decay: float = 0.01
    pooling: str = "cls"            # cls | mean
    val_fraction: float = 0.1
    seed: int = 0
    progress: bool = True
    peft: str = "full"              # full, or a PEFT method (lora, qlora, prefix, prompt, adapter, ia3)
    peft_settings: dict | None = None  # PeftConfig fields (r, alpha, target_modules, ...)
    device: str | None = None       # "auto", "cpu", "cuda[:N]", "mps"; None: the CPU

    def check(self) -> None:
        if not 1e-7 <= self.lr <= 1e-2:
            raise ConfigError(f"--lr {self.lr} is outside 1e-7..1e-2; fine-tuning uses 2e-5 to 5e-5")
        for name in ("epochs", "batch_size", "max_length"):
            if getattr(self, name) is not None and getattr(self, name) < 1:
                raise ConfigError(f"--{name.replace('_', '-')} must be at least 1")
        if not 0.0 <= self.warmup_ratio <= 1.0:
            raise ConfigError(f"--warmup-ratio must lie in [0, 1] (a share of the steps), got {self.warmup_ratio}")
        if not 0.0 <= self.weight_decay < float("inf"):
            raise ConfigError(f"--weight-decay must be a non-negative number, got {self.weight_decay}")
        if not 0 < self.val_fraction < 1:
            raise ConfigError(f"--val-fraction must be between 0 and 1 (a share of --train), got {self.val_fraction}")
        if self.pooling not in ("cls", "mean"):
            raise ConfigError(f"--pooling must be cls or mean, got {self.pooling!r}")

        check_out(self.out, self.model)


def classifier_from_pretrained(path: str | Path, num_labels: int, pooling: str = "cls", id2label: dict | None = None):
    """A sequence-classification `Encoder` whose body (and pooler, when the checkpoint has one) comes
    from the pretrained encoder at `path`; the classifier layer is fresh."""
    base = load_model(path)
    if base.config.position == "xl":  # XLNet: its sequence summary (the last position by default) and logits_proj
        return _xlnet_classifier(base, num_labels, pooling, id2label)
    if base.config.architecture != "encoder":
        arch = base.config.architecture
        raise ConfigError(f"{path} holds {'an' if arch[0] in 'aeiou' else 'a'} {arch} model; fine-tuning for "
                          "classification needs an encoder (BERT, RoBERTa, DistilBERT)")
    extra = {k: v for k, v in base.config.extra.items() if k != "id2label"}
    if id2label:
        extra["id2label"] = id2label
    task = replace(base.config.task, head=UNSET, num_labels=UNSET, pooling=UNSET, pooler=UNSET)
    act = "relu" if base.config.family == "distilbert" else "tanh"
    model = Encoder(base.config.replace(extra=extra, task=task), head="sequence", num_labels=num_labels,
                    pooling=pooling, pooler=act)
    state = {k: v for k, v in base.state_dict().items() if k.startswith("encoder.")}
    if base.pooler is not None and base.pooler.act_name == act:
        state.update({k: v for k, v in base.state_dict().items() if k.startswith("pooler.")})
    missing = model.load_state_dict(state, strict=False).missing_keys
    assert all(not k.startswith("encoder.") for k in missing), missing
    return model


def _xlnet_classifier(base, num_labels: int, pooling: str, id2label: dict | None):
    """XLNetForSequenceClassification from a pretrained XLNet: pooling "cls" keeps the folder's summary (XLNet's
    <cls> is the last token), "mean" averages the positions; summary and logits_proj are fresh."""

    extra = {k: v for k, v in base.config.extra.items() if k != "id2label"}
    if id2label:
        extra["id2label"] = id2label
    task = replace(base.config.task, head=UNSET, num_labels=UNSET)
    if pooling == "mean":
        task = replace(task, summary={**task.get("summary", {}), "summary_type": "mean"})
    model = XLNet(base.config.replace(extra=extra, task=task), head="sequence", num_labels=num_labels)
    state = {k: v for k, v in base.state_dict().items() if k.startswith("transformer.")}
    missing = model.load_state_dict(state, strict=False).missing_keys
    assert all(not k.startswith("transformer.") for k in missing), missing
    return model


def reads_last_position(model) -> bool:
    """True for a model that classifies from its last position (XLNet's summary "last"): batches pad on the left."""
    summary = model.config.task.get("summary", {}) if model.config.position == "xl" else {}
    return model.config.position == "xl" and summary.get("summary_type", "last") == "last"


def _batches(tok, examples: list[Example], labels: dict[str, int], batch_size: int, max_length: int,
             order: list[int], device: torch.device | None = None):
    device = device or torch.device("cpu")
    for start in range(0, len(order), batch_size):
        part = [examples[i] for i in order[start:start + batch_size]]
        pairs = [e.text_pair for e in part]
        enc = tok([e.text for e in part], pair=pairs if any(p is not None for p in pairs) else None, padding=True,
                  truncation=True, max_length=max_length)
        yield ({k: to_device(torch.tensor(v), device) for k, v in enc.items()},
               to_device(torch.tensor([labels[e.label] for e in part]), device))


@torch.no_grad()
def predict(model, tok, examples: list[Example], labels: dict[str, int], batch_size: int = 32,
            max_length: int = 128) -> list[int]:
    """Predicted class indices, in the order of `examples`."""
    was = model.training
    model.eval()
    order = sorted(range(len(examples)), key=lambda i: len(examples[i].text))
    preds = [0] * len(examples)
    for (inputs, _), idx in zip(_batches(tok, examples, labels, batch_size, max_length, order, module_device(model)),
                                (order[s:s + batch_size] for s in range(0, len(order), batch_size))):
        logits = model(inputs["input_ids"], attention_mask=inputs["attention_mask"],
                       token_type_ids=inputs.get("token_type_ids") if model.config.type_vocab_size else None).logits
        for i, p in zip(idx, logits.argmax(-1).tolist()):
            preds[i] = p
    model.train(was)
    return preds


def finetune(cfg: FinetuneConfig) -> dict:
    """Train, evaluate after every epoch, keep the best; returns the best epoch's metrics."""
    cfg.check()
    random.seed(cfg.seed)
    torch.manual_seed(cfg.seed)
    train = read_examples(cfg.train)
    held = read_examples(cfg.eval) if cfg.eval else None
    if held is None:
        train, held = split_examples(train, cfg.val_fraction, cfg.seed)
        if not held:  # a label holds one out only when it has two examples
            raise CorpusError(f"{cfg.train} has too few examples to hold any out for evaluation (each label needs "
                              "two); add examples or pass --eval FILE")
        if not train:
            raise CorpusError(f"--val-fraction {cfg.val_fraction} holds out all of {cfg.train}; lower it or pass --eval")
    for name, rows in (("training", train), ("evaluation", held)):
        if len({e.text_pair is None for e in rows}) > 1:
            raise CorpusError(f"some {name} rows have text_pair and some do not; give every row a text_pair or none")
    names = label_names(train, held)
    if len(names) < 2:
        raise CorpusError(f"the data has a single label ({names[0]!r}); classification needs at least two")
    labels = {n: i for i, n in enumerate(names)}
    tok = load_tokenizer(cfg.model)
    model = classifier_from_pretrained(cfg.model, len(names), cfg.pooling, {str(i): n for i, n in enumerate(names)})
    device = resolve_device(cfg.device or "cpu", "device=")
    model = model.to(device)  # before PEFT, whose layers are made where the weights they wrap are
    if reads_last_position(model):
        tok.padding_side = "left"

    cfg = replace(cfg, max_length=fitting_length(model.config.max_seq_len, cfg.peft, cfg.peft_settings or {},
                                                 cfg.max_length, 128))
    if cfg.peft != "full":  # frozen body + the method's parameters; the classifier is trained in full
        model = peft_for_task(model, cfg.peft, **(cfg.peft_settings or {}))
    model.train()
    decay = [p for n, p in model.named_parameters() if p.ndim >= 2 and "embeddings" not in n]
    no_decay = [p for n, p in model.named_parameters() if not (p.ndim >= 2 and "embeddings" not in n)]
    optimizer = torch.optim.AdamW([{"params": decay, "weight_decay": cfg.weight_decay},
                                   {"params": no_decay, "weight_decay": 0.0}], lr=cfg.lr)
    steps = cfg.epochs * math.ceil(len(train) / cfg.batch_size)
    warmup = int(cfg.warmup_ratio * steps)
    schedule = torch.optim.lr_scheduler.LambdaLR(
        optimizer, lambda s: (s + 1) / max(1, warmup) if s < warmup else max(0.0, (steps - s) / max(1, steps - warmup)))
    out = Path(cfg.out)
    out.mkdir(parents=True, exist_ok=True)
    log = out / "metrics.jsonl"
    lines, best = [], None
    gen = random.Random(cfg.seed)
    bar = progress_bar(cfg.progress, total=steps, unit="step", dynamic_ncols=True)
    t0 = time.perf_counter()
    for epoch in range(1, cfg.epochs + 1):
        order = list(range(len(train)))
        gen.shuffle(order)
        total, count = 0.0, 0
        for inputs, y in _batches(tok, train, labels, cfg.batch_size, cfg.max_length, order, device):
            result = model(inputs["input_ids"], attention_mask=inputs["attention_mask"], labels=y,
                           token_type_ids=inputs.get("token_type_ids") if model.config.type_vocab_size else None)
            with_aux_loss(result.loss, getattr(result, "aux_loss", None), model.config.router_aux_loss_coef).backward()
            torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0)
            optimizer.step()
            schedule.step()
            optimizer.zero_grad(set_to_none=True)
            total, count = total + float(result.loss.detach()) * len(y), count + len(y)
            bar.update(1)
            bar.set_postfix(epoch=epoch, loss=f"{total / count:.3f}")
        preds = predict(model, tok, held, labels, max_length=cfg.max_length)
        gold = [labels[e.label] for e in held]
        row = {"epoch": epoch, "train_loss": total / max(count, 1), "accuracy": accuracy(preds, gold),
               "macro_f1": macro_f1(preds, gold), "elapsed": round(time.perf_counter() - t0, 2)}
        if best is None or (row["macro_f1"], row["accuracy"]) > (best["macro_f1"], best["accuracy"]):
            best = dict(row)
            _save(model, tok, out)
        lines.append(json.dumps(row))
        if cfg.progress and bar.disable:  # no terminal for the bar: one plain line per epoch instead
            print(f"epoch {epoch}/{cfg.epochs}: train loss {row['train_loss']:.4f}, accuracy {row['accuracy']:.4f}, "
                  f"macro-F1 {row['macro_f1']:.4f}", file=sys.stderr, flush=True)
        atomic_write_bytes(log, ("\n".join(lines) + "\n").encode())
    bar.close()
    summary = {"best": best, "labels": names, "train_examples": len(train), "eval_examples": len(held),
               "config": asdict(cfg)}
    atomic_write_bytes(out / "finetune.json", (json.dumps(summary, indent=2) + "\n").encode())
    return best


def _save(model, tok, out: Path) -> None:
    """Model folder and tokenizer, written beside and then moved in, so a crash leaves the last best whole."""
    tmp = Path(tempfile.mkdtemp(prefix=".best.", dir=out))
    try:
        model.save_adapter(tmp) if hasattr(model, "save_adapter") else model.save_pretrained(tmp)  # PEFT: the adapter
        tok.save_pretrained(tmp)  # tokenizer_config.json too: AutoTokenizer then reads the same special tokens
        for f in sorted(tmp.iterdir()):
            f.replace(out / f.name)
    finally:
        shutil.rmtree(tmp, ignore_errors=True)
