"""`lmkit finetune --task qa`: extractive question answering in SQuAD's format on a pretrained encoder.

Rows {"id", "question", "context", "answers": {"text": [...], "answer_start": [...]}} (JSONL, or the built-in
`pydocs-qa`, data/tagging.py). The context's words (runs of non-space characters, with their character offsets)
are encoded one by one (finetune/token_classification.py: word_pieces); a feature is [CLS] question [SEP] window [SEP] (token
types 1 from the window on), windows of the context's pieces that overlap by --doc-stride pieces when the context
does not fit --max-length. Training targets are the pieces that begin the answer's first word and end its last
word, or [CLS] (position 0) where the answer is not wholly inside the window, as transformers' run_qa does. The
prediction of a question is the best start + end score over all its windows, among the n_best starts and ends
inside the context with end >= start and at most --max-answer-length pieces, mapped back to the characters from
its first word's start to its last word's end. Exact match and F1 are the SQuAD v1.1 script's (finetune/metrics.py).
"""
from __future__ import annotations

import json
import math
import random
import re
from dataclasses import asdict, dataclass, replace
from pathlib import Path

import torch
import torch.nn.functional as F

from lmkit.atomic import atomic_write_bytes
from lmkit.data.tokenize import special_ids
from lmkit.device import module_device, resolve_device, to_device
from lmkit.errors import ConfigError, CorpusError
from lmkit.finetune.classify import ClassifyJob, FinetuneConfig, classifier_from_pretrained
from lmkit.finetune.common import check_run, fitting_length, run_epochs
from lmkit.finetune.metrics import squad_scores
from lmkit.finetune.token_classification import frame, word_pieces
from lmkit.objectives import LossSum
from lmkit.tokenizers import load_tokenizer
from lmkit.train import distributed

BUILTIN = "pydocs-qa"
MAX_QUERY, N_BEST = 64, 20


def read_squad(source: str, split: str = "train") -> list[dict]:
    """SQuAD-format rows of a JSONL file, or of the built-in pydocs-qa's `split`."""
    if source == BUILTIN:
        from lmkit.data.tagging import pydocs_qa

        return pydocs_qa(split)
    path = Path(source)
    if not path.is_file():
        raise CorpusError(f"{source} is not a file; pass JSONL rows in SQuAD's format or {BUILTIN}")
    rows = []
    for n, line in enumerate(path.read_text(encoding="utf-8").splitlines(), 1):
        if not line.strip():
            continue
        try:
            row = json.loads(line)
            answers = row["answers"]
            ok = all(isinstance(row[k], str) for k in ("question", "context")) and len(answers["text"]) == len(
                answers["answer_start"]) > 0
        except (ValueError, KeyError, TypeError):
            ok = False
        if not ok:
            raise CorpusError(f"{path}:{n}: a row needs question, context and answers {{text: [...], answer_start: "
                              "[...]}} (SQuAD's format, one object per line)")
        rows.append({"id": str(row.get("id", f"{path.name}#{n}")), **{k: row[k] for k in ("question", "context")},
                     "answers": answers})
    if not rows:
        raise CorpusError(f"{path} holds no questions")
    return rows


@dataclass
class Feature:
    example: int                 # index of the row it comes from
    ids: list[int]
    types: list[int]
    word_at: list[int]           # per position: the context word it belongs to, -1 outside the window's context
    start: int = 0               # training targets (0: [CLS], the answer is not in this window)
    end: int = 0


def words(text: str) -> list[tuple[int, int]]:
    """(start, end) character offsets of the runs of non-space characters."""
    return [m.span() for m in re.finditer(r"\S+", text)]


def features(tok, row: dict, index: int, max_length: int, stride: int) -> list[Feature]:
    """The windows of one row (module docstring), with the training targets of its first answer."""
    (cls,), after = frame(tok)
    sep = after[0] if after else cls
    question = [p for w in word_pieces(tok, row["question"].split()) for p in w][:MAX_QUERY]
    spans = words(row["context"])
    per_word = word_pieces(tok, [""] + [row["context"][a:b] for a, b in spans])[1:]  # each after a space
    pieces = [p for w in per_word for p in w]
    owner = [i for i, w in enumerate(per_word) for _ in w]
    room = max_length - len(question) - 3
    if room < 1:
        raise ConfigError(f"--max-length {max_length} leaves no room for the context after a {len(question)}-piece "
                          "question; raise --max-length")
    a0 = row["answers"]["answer_start"][0]
    a1 = a0 + len(row["answers"]["text"][0])
    hit = [i for i, (s, e) in enumerate(spans) if e > a0 and s < a1]
    first = owner.index(hit[0]) if hit else -1
    last = len(owner) - 1 - owner[::-1].index(hit[-1]) if hit else -1
    out, begin = [], 0
    while True:
        end = min(begin + room, len(pieces))
        offset = len(question) + 2
        ids = [cls, *question, sep, *pieces[begin:end], sep]
        word_at = [-1] * offset + owner[begin:end] + [-1]
        f = Feature(index, ids, [0] * offset + [1] * (end - begin + 1), word_at)
        if hit and begin <= first and last < end:
            f.start, f.end = offset + first - begin, offset + last - begin
        out.append(f)
        if end >= len(pieces):
            return out
        begin = max(end - stride, begin + 1)


def pad_features(feats: list[Feature], pad: int, device=None) -> dict[str, torch.Tensor]:
    width = max(len(f.ids) for f in feats)
    ids = torch.full((len(feats), width), pad, dtype=torch.long)
    types, mask = torch.zeros_like(ids), torch.zeros_like(ids)
    for i, f in enumerate(feats):
        ids[i, :len(f.ids)], types[i, :len(f.ids)], mask[i, :len(f.ids)] = torch.tensor(f.ids), torch.tensor(f.types), 1
    batch = {"input_ids": ids, "token_type_ids": types, "attention_mask": mask,
             "start_positions": torch.tensor([f.start for f in feats]), "end_positions": torch.tensor([f.end for f in feats])}
    return {k: to_device(v, device or torch.device("cpu")) for k, v in batch.items()}


def model_inputs(model, batch: dict) -> dict:
    keep = ("input_ids", "attention_mask") + (("token_type_ids",) if model.config.type_vocab_size else ())
    return {k: batch[k] for k in keep}


def best_span(start: list[float], end: list[float], word_at: list[int], max_answer: int) -> tuple[float, int, int]:
    """(score, first word, last word) of the best start + end among the N_BEST starts and ends inside the context,
    end >= start, at most max_answer pieces; (-inf, -1, -1) when none is."""
    inside = [i for i, w in enumerate(word_at) if w >= 0]
    starts = sorted(inside, key=lambda i: -start[i])[:N_BEST]
    ends = sorted(inside, key=lambda i: -end[i])[:N_BEST]
    best = (-math.inf, -1, -1)
    for s in starts:
        for e in ends:
            if s <= e < s + max_answer and start[s] + end[e] > best[0]:
                best = (start[s] + end[e], word_at[s], word_at[e])
    return best


@torch.no_grad()
def predict_answers(model, tok, rows: list[dict], max_length: int, stride: int, max_answer: int,
                    batch_size: int = 32) -> dict[str, str]:
    """{row id: the answer text} (module docstring)."""
    was = model.training
    model.eval()
    feats = [f for i, r in enumerate(rows) for f in features(tok, r, i, max_length, stride)]
    pad, best = special_ids(tok)[1], {}
    for s in range(0, len(feats), batch_size):
        part = feats[s:s + batch_size]
        out = model(**model_inputs(model, pad_features(part, pad, module_device(model))))
        for f, st, en in zip(part, out.start_logits.float().tolist(), out.end_logits.float().tolist()):
            found = best_span(st[:len(f.ids)], en[:len(f.ids)], f.word_at, max_answer)
            if found[0] > best.get(f.example, (-math.inf,))[0]:
                best[f.example] = found
    model.train(was)
    answers = {}
    for i, r in enumerate(rows):
        _, w0, w1 = best.get(i, (None, -1, -1))
        spans = words(r["context"])
        answers[r["id"]] = r["context"][spans[w0][0]:spans[w1][1]] if w0 >= 0 else ""
    return answers


def finetune_qa(cfg: FinetuneConfig, stride: int = 32, max_answer_length: int = 30) -> dict:
    """Train on the windows of --train, score EM / F1 on the held-out questions after every epoch, keep the best."""
    cfg.check()
    if stride < 0 or max_answer_length < 1:
        raise ConfigError("--doc-stride must be 0 or more and --max-answer-length at least 1")
    precision = check_run(cfg.out, cfg.resume, cfg.save_every, cfg.precision, cfg.lr_schedule)
    if cfg.peft != "full":
        raise ConfigError("--task qa trains in full; drop --peft")
    random.seed(cfg.seed)
    torch.manual_seed(cfg.seed)
    rows = read_squad(cfg.train)
    if cfg.eval or cfg.train == BUILTIN:
        held = read_squad(cfg.eval or BUILTIN, "validation")
    else:
        random.Random(cfg.seed).shuffle(rows)
        k = max(1, round(cfg.val_fraction * len(rows)))
        held, rows = rows[:k], rows[k:]
        if not rows:
            raise CorpusError(f"{cfg.train} has too few questions to hold some out; add more or pass --eval FILE")
    tok = load_tokenizer(cfg.model)
    model = classifier_from_pretrained(cfg.model, 2, head="qa").to(resolve_device(cfg.device or "cpu", "device="))
    cfg = replace(cfg, max_length=fitting_length(model.config.max_seq_len, "full", {}, cfg.max_length, 128),
                  precision=precision)
    feats = [f for i, r in enumerate(rows) for f in features(tok, r, i, cfg.max_length, stride)]
    job = QAJob(cfg, model, tok, feats, held, {}, stride, max_answer_length)
    per_epoch = math.ceil(len(feats) / cfg.batch_size)
    ctx = distributed.setup(module_device(model))
    run_epochs(job, cfg, per_epoch, precision, ctx)
    if ctx.is_main:
        summary = {"best": job.best, "train_questions": len(rows), "train_features": len(feats),
                   "eval_questions": len(held), "doc_stride": stride, "max_answer_length": max_answer_length,
                   "config": asdict(cfg)}
        atomic_write_bytes(Path(cfg.out) / "finetune.json", (json.dumps(summary, indent=2) + "\n").encode())
    return job.best


class QAObjective:
    """Cross-entropy of the start and of the end position, halved and summed over the features."""

    def count(self, batch) -> int:
        return len(batch["start_positions"])

    def loss(self, model, batch) -> tuple[LossSum, torch.Tensor | None]:
        out = model(**model_inputs(model, batch))
        nats = (F.cross_entropy(out.start_logits.float(), batch["start_positions"], reduction="sum")
                + F.cross_entropy(out.end_logits.float(), batch["end_positions"], reduction="sum")) / 2
        return LossSum(nats, torch.tensor(self.count(batch))), getattr(out, "aux_loss", None)


class QAJob(ClassifyJob):
    """Extractive QA on the classification job's epochs (over features): its batches, loss, EM and F1."""

    best_by = ("f1", "exact_match")

    def __init__(self, cfg, model, tok, train: list[Feature], held: list[dict], labels: dict, stride: int,
                 max_answer: int):
        super().__init__(cfg, model, tok, train, held, labels)
        self.objective, self.stride, self.max_answer, self.pad = QAObjective(), stride, max_answer, special_ids(tok)[1]

    def batches(self, indices: list[int]) -> list:
        return [pad_features([self.train[i] for i in indices], self.pad, module_device(self.model))]

    def evaluate(self, precision: str) -> dict[str, float]:
        pred = predict_answers(self.model, self.tok, self.held, self.cfg.max_length, self.stride, self.max_answer)
        return squad_scores(pred, {r["id"]: r["answers"]["text"] for r in self.held})

    def report_line(self, loop, row: dict, result: dict) -> str:
        return (f"epoch {row['epoch']}/{self.cfg.epochs}: train loss {row['train_loss']:.4f}, exact match "
                f"{row['exact_match']:.2f}, F1 {row['f1']:.2f}")
