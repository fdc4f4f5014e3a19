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
import tempfile
from dataclasses import asdict, dataclass, replace
from pathlib import Path

import torch

from lmkit.atomic import atomic_write_bytes
from lmkit.config_sections import UNSET
from lmkit.device import module_device, resolve_device, to_device
from lmkit.errors import ConfigError, CorpusError
from lmkit.finetune.common import check_out, check_run, fitting_length, peft_for_task, run_epochs
from lmkit.finetune.data import Example, label_names, read_examples, split_examples
from lmkit.finetune.metrics import accuracy, macro_f1
from lmkit.hub import load_model
from lmkit.models.encoder import Encoder
from lmkit.models.xlnet import XLNet
from lmkit.objectives import LossSum
from lmkit.tokenizers import load_tokenizer
from lmkit.train import distributed
from lmkit.train.job import Job


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
    precision: str | None = None    # fp32 | bf16 (autocast); None: bf16 where faster (fast_precision)
    lr_schedule: str = "linear"     # after the warm-up: linear (to 0) | cosine | constant
    save_every: int | None = None   # a checkpoint every N steps (out/checkpoint), for resume
    resume: bool = False            # continue the run in out from its latest checkpoint
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


def classifier_from_pretrained(path: str | Path, num_labels: int, pooling: str = "cls", id2label: dict | None = None,
                               head: str = "sequence"):
    """An `Encoder` with a fresh `head` (sequence: classification, with the checkpoint's pooler when it has one;
    token: a label per position; qa: start and end scores) on the body of the pretrained encoder at `path`."""
    base = load_model(path)
    if base.config.position == "xl" and head == "sequence":  # XLNet: its sequence summary and logits_proj
        return _xlnet_classifier(base, num_labels, pooling, id2label)
    if base.config.architecture != "encoder" or base.config.position == "xl":
        arch = base.config.architecture if base.config.position != "xl" else "XLNet"
        raise ConfigError(f"{path} holds {'an' if arch[0] in 'aeiouAEIOU' else 'a'} {arch} model; fine-tuning for "
                          f"{'classification' if head == 'sequence' else head + ' tasks'} needs an encoder (BERT, "
                          "RoBERTa, DistilBERT)")
    extra = {k: v for k, v in base.config.extra.items() if k != "id2label"}
    if id2label:
        extra["id2label"] = id2label
    task = replace(base.config.task, head=UNSET, num_labels=UNSET, pooling=UNSET, pooler=UNSET)
    act = "relu" if base.config.family == "distilbert" else "tanh"
    pooled = head == "sequence"
    model = Encoder(base.config.replace(extra=extra, task=task), head=head, num_labels=num_labels,
                    pooling=pooling, pooler=act if pooled else None)
    state = {k: v for k, v in base.state_dict().items() if k.startswith("encoder.")}
    if pooled and base.pooler is not None and base.pooler.act_name == act:
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
    """Train, evaluate after every epoch, keep the best; returns the best epoch's metrics (its metrics.jsonl row)."""
    cfg.check()
    precision = check_run(cfg.out, cfg.resume, cfg.save_every, cfg.precision, cfg.lr_schedule)
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
                                                 cfg.max_length, 128), precision=precision)
    if cfg.peft != "full":  # frozen body + the method's parameters; the classifier is trained in full
        model = peft_for_task(model, cfg.peft, **(cfg.peft_settings or {}))
    job = ClassifyJob(cfg, model, tok, train, held, labels)
    per_epoch = math.ceil(len(train) / cfg.batch_size)
    ctx = distributed.setup(device)
    run_epochs(job, cfg, per_epoch, precision, ctx)
    if not ctx.is_main:  # under torchrun rank 0 writes
        return job.best
    summary = {"best": job.best, "labels": names, "train_examples": len(train), "eval_examples": len(held),
               "config": asdict(cfg)}
    atomic_write_bytes(Path(cfg.out) / "finetune.json", (json.dumps(summary, indent=2) + "\n").encode())
    return job.best


class ClassifyJob(Job):
    """Classification as a job of the one loop: epochs of shuffled batches, the head's cross-entropy (a mean over
    the step's examples), accuracy and macro-F1 on the held-out rows after each epoch, the best model kept."""

    written_files = ("finetune.json", "config.json", "model.safetensors", "adapter_config.json",
                     "adapter_model.safetensors", "tokenizer.json", "tokenizer_config.json", "special_tokens_map.json")
    temporary_prefixes = (".best.",)
    best_by = ("macro_f1", "accuracy")  # the held-out metrics that pick the kept model, in order

    def __init__(self, cfg: FinetuneConfig, model, tok, train: list[Example], held: list[Example],
                 labels: dict[str, int]):
        self.cfg, self.model, self.tok, self.train, self.held, self.labels = cfg, model, tok, train, held, labels
        self.seed, self.objective = cfg.seed, ClassifyObjective(model.config.type_vocab_size > 0)
        self.per_epoch = math.ceil(len(train) / cfg.batch_size)
        self.gen, self.order = random.Random(cfg.seed), []
        self.total, self.count, self.best, self.row = 0.0, 0, None, {}

    def build_optimizer(self) -> torch.optim.Optimizer:
        decayed = [p for n, p in self.model.named_parameters() if p.ndim >= 2 and "embeddings" not in n]
        kept = [p for n, p in self.model.named_parameters() if not (p.ndim >= 2 and "embeddings" not in n)]
        return torch.optim.AdamW([{"params": decayed, "weight_decay": self.cfg.weight_decay},
                                  {"params": kept, "weight_decay": 0.0}], lr=self.cfg.lr)

    def warmup(self, total_steps: int | None) -> int:
        return int(self.cfg.warmup_ratio * self.cfg.epochs * self.per_epoch)

    def micro_batches(self, step: int, rank: int, world_size: int) -> list:
        at = step % self.per_epoch
        if at == 0:
            self.order = list(range(len(self.train)))
            self.gen.shuffle(self.order)
        part = self.order[at * self.cfg.batch_size:(at + 1) * self.cfg.batch_size]
        return self.batches(part[rank * len(part) // world_size:(rank + 1) * len(part) // world_size])

    def batches(self, indices: list[int]) -> list:
        """The micro-batches of the training examples at `indices` (one, here)."""
        return list(_batches(self.tok, self.train, self.labels, len(indices), self.cfg.max_length, indices))

    def step_row(self, loop, seconds: float, result: dict | None) -> dict:
        self.total, self.count = self.total + loop.last_loss * loop.step_count, self.count + loop.step_count
        if result is None:
            return {}
        row = {"epoch": -(-loop.step // self.per_epoch), "train_loss": self.total / max(self.count, 1), **result}
        self.total, self.count = 0.0, 0
        return row

    def evaluate(self, precision: str) -> dict[str, float]:
        preds = predict(self.model, self.tok, self.held, self.labels, max_length=self.cfg.max_length)
        gold = [self.labels[e.label] for e in self.held]
        return {"accuracy": accuracy(preds, gold), "macro_f1": macro_f1(preds, gold)}

    def logged(self, loop, row: dict) -> None:
        """After an epoch's row: the model saved when it is the best so far (by `best_by`, in order)."""
        if self.best is None or [row[k] for k in self.best_by] > [self.best[k] for k in self.best_by]:
            self.best = dict(row)
            _save(self.model, self.tok, Path(self.cfg.out))

    def postfix(self, row: dict, result: dict | None) -> dict[str, str]:
        return {"epoch": str(-(-row["step"] // self.per_epoch)), "loss": f"{row['loss']:.3f}"}

    def report_line(self, loop, row: dict, result: dict) -> str:
        return (f"epoch {row['epoch']}/{self.cfg.epochs}: train loss {row['train_loss']:.4f}, accuracy "
                f"{row['accuracy']:.4f}, macro-F1 {row['macro_f1']:.4f}")

    def state(self) -> dict:
        version, internal, gauss = self.gen.getstate()
        return {"rng": [version, list(internal), gauss], "order": self.order, "total": self.total,
                "count": self.count, "best": self.best}

    def load_state(self, state: dict) -> None:
        version, internal, gauss = state["rng"]
        self.gen.setstate((version, tuple(internal), gauss))
        self.order, self.total, self.count, self.best = state["order"], state["total"], state["count"], state["best"]


class ClassifyObjective:
    """Cross-entropy of the classification head, as a sum over the batch's examples."""

    def __init__(self, token_types: bool):
        self.token_types = token_types

    def count(self, batch) -> int:
        return len(batch[1])

    def loss(self, model, batch) -> tuple[LossSum, torch.Tensor | None]:
        inputs, y = batch
        result = model(inputs["input_ids"], attention_mask=inputs["attention_mask"], labels=y,
                       token_type_ids=inputs.get("token_type_ids") if self.token_types else None)
        return LossSum(result.loss * len(y), torch.tensor(len(y))), getattr(result, "aux_loss", None)


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
