"""`lmkit finetune --task token`: NER-style token classification of a pretrained encoder.

Rows are sentences as words with one tag each (JSONL {"tokens": [...], "tags": [...]}, `ner_tags` also read, or the
built-in `pydocs-ner`, data/tagging.py). Each word is encoded on its own (after a space, as it reads in running
text); the word's tag is the label of its first piece and the other pieces get -100, as transformers'
token-classification guide aligns them, so the loss (mean cross-entropy over labelled pieces) and the prediction
read one piece per word. Sentences are framed as in pre-training ([CLS] ... [SEP], or BOS ...) and cut at
--max-length pieces; words cut off are predicted O. After each epoch: entity-level precision, recall and F1
(seqeval's default, finetune/metrics.py) on the held-out sentences; the best epoch by F1 is the saved model (a
...ForTokenClassification folder with id2label).
"""
from __future__ import annotations

import json
import math
import random
from dataclasses import asdict, replace
from pathlib import Path

import torch

from lmkit.atomic import atomic_write_bytes
from lmkit.data.tokenize import special_ids
from lmkit.device import module_device, resolve_device, to_device
from lmkit.errors import CorpusError
from lmkit.finetune.classify import ClassifyJob, FinetuneConfig, classifier_from_pretrained
from lmkit.finetune.common import check_run, fitting_length, peft_for_task, run_epochs
from lmkit.finetune.metrics import entity_scores
from lmkit.objectives import IGNORE_INDEX, LossSum
from lmkit.tokenizers import load_tokenizer
from lmkit.train import distributed

BUILTIN = "pydocs-ner"


def read_tagged(source: str, split: str = "train") -> list[dict]:
    """Rows {"tokens", "tags"} of a JSONL file, or of the built-in pydocs-ner's `split`."""
    if source == BUILTIN:
        from lmkit.data.tagging import pydocs_ner

        return pydocs_ner(split)
    path = Path(source)
    if not path.is_file():
        raise CorpusError(f"{source} is not a file; pass JSONL rows {{\"tokens\": [...], \"tags\": [...]}} or "
                          f"{BUILTIN}")
    rows = []
    for n, line in enumerate(path.read_text(encoding="utf-8").splitlines(), 1):
        if not line.strip():
            continue
        try:
            row = json.loads(line)
        except ValueError as exc:
            raise CorpusError(f"{path}:{n} is not a JSON object ({exc}); one object per line") from None
        tags = row.get("tags", row.get("ner_tags")) if isinstance(row, dict) else None
        words = row.get("tokens") if isinstance(row, dict) else None
        if not isinstance(words, list) or not isinstance(tags, list) or len(words) != len(tags) or not words:
            raise CorpusError(f"{path}:{n}: a row needs `tokens` and `tags` (or `ner_tags`), lists of one length")
        rows.append({"tokens": [str(w) for w in words], "tags": [str(t) for t in tags]})
    if not rows:
        raise CorpusError(f"{path} holds no sentences")
    return rows


def frame(tok) -> tuple[list[int], list[int]]:
    """(ids before, ids after) a sentence: [CLS] and [SEP] when the tokenizer has them, else the BOS that pre-training
    rows start with."""
    cls, sep = getattr(tok, "cls_token_id", None), getattr(tok, "sep_token_id", None)
    return [special_ids(tok)[0] if cls is None else int(cls)], [] if sep is None else [int(sep)]


def word_pieces(tok, words: list[str]) -> list[list[int]]:
    """Each word's ids, encoded alone; words after the first as they read in text, after a space."""
    return [list(tok.encode(w if i == 0 else " " + w, add_special_tokens=False)) for i, w in enumerate(words)]


def encode(tok, words: list[str], tags: list[int], max_length: int) -> tuple[list[int], list[int], list[int]]:
    """(ids, labels, the position of each kept word's first piece): labels hold a word's tag at its first piece and
    IGNORE_INDEX elsewhere; words past max_length pieces (the frame included) are left out."""
    before, after = frame(tok)
    room = max_length - len(before) - len(after)
    ids, labels, firsts = list(before), [IGNORE_INDEX] * len(before), []
    for pieces, tag in zip(word_pieces(tok, words), tags):
        if not pieces or len(ids) - len(before) + len(pieces) > room:
            break
        firsts.append(len(ids))
        ids += pieces
        labels += [tag] + [IGNORE_INDEX] * (len(pieces) - 1)
    return ids + after, labels + [IGNORE_INDEX] * len(after), firsts


def pad_batch(rows: list[tuple[list[int], list[int]]], pad: int, device=None) -> dict[str, torch.Tensor]:
    """input_ids, attention_mask and labels of (ids, labels) rows, right-padded."""
    width = max(len(r[0]) for r in rows)
    ids = torch.full((len(rows), width), pad, dtype=torch.long)
    labels = torch.full_like(ids, IGNORE_INDEX)
    mask = torch.zeros_like(ids)
    for i, (x, y) in enumerate(rows):
        ids[i, :len(x)], labels[i, :len(y)], mask[i, :len(x)] = torch.tensor(x), torch.tensor(y), 1
    return {k: to_device(v, device or torch.device("cpu")) for k, v in
            {"input_ids": ids, "attention_mask": mask, "labels": labels}.items()}


@torch.no_grad()
def predict_tags(model, tok, rows: list[dict], names: list[str], max_length: int, batch_size: int = 32) -> list[list[str]]:
    """The predicted tag of every word of `rows` (O for words cut off by max_length)."""
    was = model.training
    model.eval()
    pad = special_ids(tok)[1]
    out = []
    for start in range(0, len(rows), batch_size):
        part = rows[start:start + batch_size]
        encoded = [encode(tok, r["tokens"], [0] * len(r["tokens"]), max_length) for r in part]
        batch = pad_batch([(ids, labels) for ids, labels, _ in encoded], pad, module_device(model))
        best = model(batch["input_ids"], attention_mask=batch["attention_mask"]).logits.argmax(-1).tolist()
        for r, (_, _, firsts), pred in zip(part, encoded, best):
            tags = [names[pred[p]] for p in firsts]
            out.append(tags + ["O"] * (len(r["tokens"]) - len(tags)))
    model.train(was)
    return out


def finetune_token(cfg: FinetuneConfig) -> dict:
    """Train, score entities on the held-out sentences after every epoch, keep the best; returns its metrics row."""
    cfg.check()
    precision = check_run(cfg.out, cfg.resume, cfg.save_every, cfg.precision, cfg.lr_schedule)
    random.seed(cfg.seed)
    torch.manual_seed(cfg.seed)
    train = read_tagged(cfg.train)
    if cfg.eval:
        held = read_tagged(cfg.eval, "validation")
    elif cfg.train == BUILTIN:
        held = read_tagged(BUILTIN, "validation")
    else:
        order = list(range(len(train)))
        random.Random(cfg.seed).shuffle(order)
        k = max(1, round(cfg.val_fraction * len(train)))
        if len(train) < 2:
            raise CorpusError(f"{cfg.train} has one sentence; pass more, or held-out ones with --eval FILE")
        held, train = [train[i] for i in order[:k]], [train[i] for i in order[k:]]
    names = sorted({t for r in train + held for t in r["tags"]}, key=lambda t: (t != "O", t))
    labels = {n: i for i, n in enumerate(names)}
    tok = load_tokenizer(cfg.model)
    model = classifier_from_pretrained(cfg.model, len(names), id2label={str(i): n for i, n in enumerate(names)},
                                       head="token")
    model = model.to(resolve_device(cfg.device or "cpu", "device="))
    cfg = replace(cfg, max_length=fitting_length(model.config.max_seq_len, cfg.peft, cfg.peft_settings or {},
                                                 cfg.max_length, 128), precision=precision)
    if cfg.peft != "full":
        model = peft_for_task(model, cfg.peft, **(cfg.peft_settings or {}))
    job = TokenJob(cfg, model, tok, train, held, labels)
    per_epoch = math.ceil(len(train) / cfg.batch_size)
    ctx = distributed.setup(module_device(model))
    run_epochs(job, cfg, per_epoch, precision, ctx)
    if ctx.is_main:
        summary = {"best": job.best, "labels": names, "train_sentences": len(train), "eval_sentences": len(held),
                   "config": asdict(cfg)}
        atomic_write_bytes(Path(cfg.out) / "finetune.json", (json.dumps(summary, indent=2) + "\n").encode())
    return job.best


class TokenObjective:
    """Cross-entropy of the token head summed over the labelled pieces (each word's first)."""

    def count(self, batch) -> int:
        return int((batch["labels"] != IGNORE_INDEX).sum())

    def loss(self, model, batch) -> tuple[LossSum, torch.Tensor | None]:
        out = model(batch["input_ids"], attention_mask=batch["attention_mask"])
        labels = batch["labels"]
        nats = torch.nn.functional.cross_entropy(out.logits.flatten(0, 1).float(), labels.reshape(-1),
                                                 ignore_index=IGNORE_INDEX, reduction="sum")
        return LossSum(nats, (labels != IGNORE_INDEX).sum()), getattr(out, "aux_loss", None)


class TokenJob(ClassifyJob):
    """Token classification on the classification job's epochs: its batches, loss and entity scores."""

    best_by = ("f1", "accuracy")

    def __init__(self, cfg: FinetuneConfig, model, tok, train: list[dict], held: list[dict], labels: dict[str, int]):
        super().__init__(cfg, model, tok, train, held, labels)
        self.objective, self.names = TokenObjective(), list(labels)
        self.pad = special_ids(tok)[1]

    def batches(self, indices: list[int]) -> list:
        rows = [self.train[i] for i in indices]
        encoded = [encode(self.tok, r["tokens"], [self.labels[t] for t in r["tags"]], self.cfg.max_length)[:2]
                   for r in rows]
        return [pad_batch(encoded, self.pad, module_device(self.model))]

    def evaluate(self, precision: str) -> dict[str, float]:
        pred = predict_tags(self.model, self.tok, self.held, self.names, self.cfg.max_length)
        return entity_scores(pred, [r["tags"] for r in self.held])

    def report_line(self, loop, row: dict, result: dict) -> str:
        return (f"epoch {row['epoch']}/{self.cfg.epochs}: train loss {row['train_loss']:.4f}, entity precision "
                f"{row['precision']:.4f}, recall {row['recall']:.4f}, F1 {row['f1']:.4f}")
