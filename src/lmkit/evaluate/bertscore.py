"""BERTScore (Zhang et al. 2020) as the `bert-score` package computes it, on an encoder folder lmkit loads.

Each sentence is encoded with [CLS] ... [SEP] by the first `num_layers` layers; token vectors are L2-normalised.
For a candidate x and reference y: R = sum_{i in y} w_i max_{j in x} cos(y_i, x_j) / sum w_i, P the same with the
roles swapped, F = 2PR / (P + R). Weights w are 1 (0 for [CLS]/[SEP]), or idf(t) = log((M + 1) / (df(t) + 1))
over the M references. Baseline rescaling maps s to (s - b) / (1 - b). As in bert-score, pairs are matched in
batches of `batch_size` whose shorter sentences are padded with vectors that score 0, so a token whose every
similarity is negative matches 0 where padding is present.
"""
from __future__ import annotations

import csv
import math
from collections import Counter
from pathlib import Path
from typing import Sequence

import torch
import torch.nn.functional as F
from torch.nn.utils.rnn import pad_sequence

from lmkit.errors import MetricError


def _encode_ids(tokenizer, sentence: str, max_length: int) -> list[int]:
    """bert-score's `sent_encode`: the stripped sentence with the special tokens, cut at the model's length."""
    ids = tokenizer.encode(sentence.strip()) if sentence.strip() else tokenizer.encode("")
    if len(ids) > max_length:
        ids = ids[: max_length - 1] + ids[-1:]
    return ids


def idf_weights(references: Sequence[str], tokenizer, max_length: int = 512) -> dict[int, float]:
    """idf(t) = log((M + 1) / (df(t) + 1)) over the M references (unseen tokens: log(M + 1))."""
    counts = Counter()
    for ref in references:
        counts.update(set(_encode_ids(tokenizer, ref, max_length)))
    return {t: math.log((len(references) + 1) / (c + 1)) for t, c in counts.items()}


def _truncated(model, num_layers: int | None):
    layers = model.encoder.layers
    if num_layers is None:
        return model
    if not 0 <= num_layers <= len(layers):
        raise MetricError(f"num_layers must be between 0 and {len(layers)} for this encoder, got {num_layers}")
    model.encoder.layers = torch.nn.ModuleList(list(layers)[:num_layers])
    return model


@torch.no_grad()
def _embed(model, rows: list[list[int]], pad_id: int, batch_size: int) -> list[torch.Tensor]:
    """Each row's token vectors from the (truncated) encoder, batched with an attention mask."""
    out: list[torch.Tensor] = []
    device = next(model.parameters()).device
    for start in range(0, len(rows), batch_size):
        batch = rows[start:start + batch_size]
        ids = pad_sequence([torch.tensor(r) for r in batch], batch_first=True, padding_value=pad_id).to(device)
        mask = (torch.arange(ids.shape[1], device=device)[None] < torch.tensor([len(r) for r in batch],
                                                                                device=device)[:, None]).long()
        h = model(ids, attention_mask=mask).last_hidden_state.float().cpu()
        out += [h[i, :len(r)] for i, r in enumerate(batch)]
    return out


def _greedy(ref_emb, ref_w, hyp_emb, hyp_w) -> torch.Tensor:
    """(P, R, F) of one batch of pairs, bert-score's `greedy_cos_idf` (padding vectors score 0)."""
    def pad(embs, weights):
        lens = torch.tensor([e.shape[0] for e in embs])
        e = F.normalize(pad_sequence(embs, batch_first=True), dim=-1)
        mask = torch.arange(e.shape[1])[None] < lens[:, None]
        w = pad_sequence(weights, batch_first=True)
        return e, mask, w / w.sum(dim=1, keepdim=True)
    r, rmask, rw = pad(ref_emb, ref_w)
    h, hmask, hw = pad(hyp_emb, hyp_w)
    sim = torch.bmm(h, r.transpose(1, 2)) * (hmask[:, :, None] & rmask[:, None, :])
    p = (sim.max(dim=2).values * hw).sum(dim=1)
    rec = (sim.max(dim=1).values * rw).sum(dim=1)
    f = (2 * p * rec / (p + rec)).nan_to_num(0.0)
    empty = (hmask.sum(1) == 2) | (rmask.sum(1) == 2)  # only [CLS] [SEP]: bert-score scores 0
    return torch.stack([p.masked_fill(empty, 0.0), rec.masked_fill(empty, 0.0), f], dim=-1)


def read_baseline(path: str | Path, num_layers: int) -> torch.Tensor:
    """(P, R, F) baselines of layer `num_layers` from a bert-score baseline file (LAYER,P,R,F rows)."""
    try:
        rows = list(csv.reader(Path(path).read_text(encoding="utf-8").splitlines()))
        return torch.tensor([float(x) for x in rows[1 + num_layers][1:4]])
    except (OSError, IndexError, ValueError) as exc:
        raise MetricError(f"cannot read the baseline for layer {num_layers} from {path} ({exc}); give a CSV with a "
                          "LAYER,P,R,F header and one row per layer, as bert-score ships them") from None


def _model_max_length(folder: Path) -> int:
    """tokenizer_config.json's model_max_length (transformers' cut), else the position table's size."""
    import json
    config = folder / "tokenizer_config.json"
    length = json.loads(config.read_text(encoding="utf-8")).get("model_max_length") if config.is_file() else None
    if isinstance(length, int) and 0 < length < 10 ** 9:
        return length
    return json.loads((folder / "config.json").read_text(encoding="utf-8")).get("max_position_embeddings", 512)


def bert_score(candidates: Sequence[str], references: Sequence[str] | Sequence[Sequence[str]], folder: str | Path,
               num_layers: int | None = None, idf: bool = False, batch_size: int = 64,
               baseline_path: str | Path | None = None, device=None) -> dict[str, torch.Tensor]:
    """{"precision", "recall", "f1"}: one value per candidate, as `bert_score.score(cands, refs, model_type=folder,
    num_layers=..., idf=..., rescale_with_baseline=baseline_path is not None, baseline_path=...)` returns them.

    folder: a BERT-style encoder (a sentence-transformers folder works: its transformer is read).
    references: one string per candidate, or a list of strings per candidate (its best reference counts).
    num_layers: the layers to run (default all)."""
    import lmkit

    folder = Path(folder)
    model = lmkit.load_model(folder, device=device)
    tokenizer = lmkit.load_tokenizer(folder)
    candidates = list(candidates)
    if not candidates or len(candidates) != len(references):
        raise MetricError(f"{len(candidates)} candidates and {len(references)} references; give one reference (or a "
                          "list of them) per candidate, at least one")
    groups = [[r] if isinstance(r, str) else list(r) for r in references]
    if any(not g or not all(isinstance(x, str) for x in g) for g in groups) or \
            not all(isinstance(c, str) for c in candidates):
        raise MetricError("candidates and references must be strings (a non-empty list of them per candidate)")
    refs = [r for g in groups for r in g]
    cands = [c for c, g in zip(candidates, groups) for _ in g]
    model = _truncated(model.eval(), num_layers)
    max_length = _model_max_length(folder)
    specials = {tokenizer.token_to_id(t) for t in ("[CLS]", "[SEP]")} - {None}
    weights = idf_weights(refs, tokenizer, max_length) if idf else None
    unseen = math.log(len(refs) + 1)
    unique = sorted(set(refs + cands), key=lambda s: len(s.split(" ")), reverse=True)
    rows = {s: _encode_ids(tokenizer, s, max_length) for s in unique}
    pad_id = tokenizer.token_to_id("[PAD]") or 0
    embs = dict(zip(unique, _embed(model, [rows[s] for s in unique], pad_id, batch_size)))

    def w(sentence):
        ids = rows[sentence]
        if weights is None:
            return torch.tensor([0.0 if t in specials else 1.0 for t in ids])
        return torch.tensor([weights.get(t, unseen) for t in ids])

    preds = torch.cat([_greedy([embs[r] for r in refs[i:i + batch_size]], [w(r) for r in refs[i:i + batch_size]],
                               [embs[c] for c in cands[i:i + batch_size]], [w(c) for c in cands[i:i + batch_size]])
                       for i in range(0, len(refs), batch_size)])
    ends = torch.tensor([len(g) for g in groups]).cumsum(0).tolist()
    preds = torch.stack([preds[e - len(g):e].max(dim=0).values for e, g in zip(ends, groups)])
    if baseline_path is not None:
        base = read_baseline(baseline_path, num_layers if num_layers is not None else len(model.encoder.layers))
        preds = (preds - base) / (1 - base)
    return {"precision": preds[:, 0], "recall": preds[:, 1], "f1": preds[:, 2]}
