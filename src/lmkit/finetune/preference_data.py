"""Preference pairs as TRL's DPOTrainer (1.16) reads and tokenizes them, and their batches.

Row formats (JSONL, one per line; every row of a file in the same format):
    {"prompt": str, "chosen": str, "rejected": str}              standard
    {"prompt": [messages], "chosen": [messages], "rejected": [messages]}   conversational
    {"chosen": ..., "rejected": ...}                             implicit prompt: the shared prefix (TRL's extract_prompt)
Standard completions get the EOS token appended (unless they end with it); conversational rows are rendered by the
chat template, the prompt with the generation prompt. The completion starts where the tokens of the prompt alone and
of prompt + completion diverge (TRL's common prefix). A batch of n pairs is 2n rows, the n chosen then the n rejected,
each prompt + completion cut to max_length from the end (TRL's keep_start) and right-padded.
"""
from __future__ import annotations

import json
from dataclasses import dataclass
from pathlib import Path

import torch

from lmkit.errors import CorpusError, LmkitError
from lmkit.finetune.sft_data import _check_messages, _common_prefix

FIELDS = ("prompt", "chosen", "rejected")


@dataclass
class PreferencePair:
    prompt_ids: list[int]
    chosen_ids: list[int]
    rejected_ids: list[int]
    ref_chosen: float | None = None     # the reference model's log-probabilities, when precomputed
    ref_rejected: float | None = None


def _read_jsonl(path) -> list[tuple[int, object]]:
    path = Path(path)
    try:
        raw = path.read_bytes()
    except OSError as exc:
        raise CorpusError(f"cannot read {path}: {exc.strerror or exc}") from None
    rows = []
    for n, line in enumerate(raw.split(b"\n"), start=1):
        if not line.strip():
            continue
        try:
            rows.append((n, json.loads(line.decode("utf-8"))))
        except UnicodeDecodeError as exc:
            raise CorpusError(f"{path}:{n}: bytes that are not UTF-8 (at byte {exc.start}); re-save the file as UTF-8") from None
        except ValueError as exc:
            raise CorpusError(f"{path}:{n}: not a JSON object ({exc.msg}); write one JSON object per line") from None
    if not rows:
        raise CorpusError(f"{path} holds no rows; write one JSON object per line with \"prompt\", \"chosen\" and "
                          "\"rejected\"")
    return rows


def preference_format(row, where: str) -> str:
    """"standard" or "conversational", with "implicit_" in front when the row has no prompt; checks the row."""
    if not isinstance(row, dict):
        raise CorpusError(f"{where}: a row is a JSON object, not {type(row).__name__}")
    missing = [k for k in ("chosen", "rejected") if k not in row]
    if missing:
        raise CorpusError(f"{where}: the row has no {' or '.join(repr(k) for k in missing)}; a preference row needs "
                          "\"chosen\" and \"rejected\" (and \"prompt\", unless both completions start with it)")
    keys = [k for k in FIELDS if k in row]
    conversational = isinstance(row["chosen"], list)
    for k in keys:
        if conversational:
            _check_messages(row[k], where, k)
        elif not isinstance(row[k], str):
            raise CorpusError(f"{where}: {k!r} must be text like \"chosen\", or every field a list of messages")
    if row["chosen"] == row["rejected"]:
        raise CorpusError(f"{where}: chosen equals rejected, so the pair prefers nothing; drop the row or give a "
                          "different rejected answer")
    return ("" if "prompt" in row else "implicit_") + ("conversational" if conversational else "standard")


def extract_prompt(row: dict) -> dict:
    """TRL's extract_prompt: the longest shared prefix of chosen and rejected (text or turns) becomes the prompt;
    a space just before the split stays with the completions."""
    chosen, rejected = row["chosen"], row["rejected"]
    idx = 0
    for idx in range(min(len(chosen), len(rejected))):
        if chosen[idx] != rejected[idx]:
            if chosen[idx - 1] == " ":
                idx -= 1
            break
    return {**row, "prompt": chosen[:idx], "chosen": chosen[idx:], "rejected": rejected[idx:]}


def read_preference_rows(path) -> tuple[list[tuple[int, dict]], str]:
    """([(line, row with a prompt)], format) of a JSONL file of preference rows; errors name the file and line.
    The built-in `pydocs-preference` (its train split; `pydocs-preference:validation` for the other) reads as a file."""
    if str(path).startswith("pydocs-preference") and not Path(path).exists():
        from lmkit.data.instruct import pydocs_preference

        split = str(path).partition(":")[2] or "train"
        return [(i + 1, r) for i, r in enumerate(pydocs_preference(split))], "conversational"
    rows, kind = [], None
    for n, row in _read_jsonl(path):
        where = f"{path}:{n}"
        this = preference_format(row, where)
        if kind is not None and this != kind:
            raise CorpusError(f"{where}: a {this} row in a file of {kind} rows; use one format per file")
        kind = this
        rows.append((n, extract_prompt(row) if this.startswith("implicit_") else row))
    return rows, kind


def tokenize_pair(tok, row: dict, eos_token: str | None) -> PreferencePair:
    """prompt / chosen / rejected ids of one row, as DPOTrainer's tokenize_fn makes them."""
    if isinstance(row["chosen"], list):
        tools = row.get("tools")
        extra = {"tools": json.loads(tools) if isinstance(tools, str) else tools, **(row.get("chat_template_kwargs") or {})}
        encode = lambda messages, **kw: tok.apply_chat_template(messages, return_dict=True, **kw, **extra)["input_ids"]  # noqa: E731
        prompt_ids = encode(row["prompt"], add_generation_prompt=True)
        chosen = encode(row["prompt"] + row["chosen"])
        rejected = encode(row["prompt"] + row["rejected"])
    else:
        c, r = row["chosen"], row["rejected"]
        if eos_token:
            c, r = (c if c.endswith(eos_token) else c + eos_token), (r if r.endswith(eos_token) else r + eos_token)
        prompt_ids, chosen, rejected = tok.encode(row["prompt"]), tok.encode(row["prompt"] + c), tok.encode(row["prompt"] + r)
    start = min(_common_prefix(prompt_ids, chosen), _common_prefix(prompt_ids, rejected))
    return PreferencePair(prompt_ids[:start], chosen[start:], rejected[start:])


def prepare_pairs(tok, path, max_length: int, max_prompt_length: int | None = None) -> tuple[list[PreferencePair], dict]:
    """Tokenized pairs of a JSONL file and a report. A prompt that fills max_length (TRL drops such rows silently: no
    completion token would be left) or passes max_prompt_length is an error naming the file and line; the built-in
    pydocs-preference, which cannot be edited, leaves rows whose prompt fills max_length out (report["dropped"])."""
    rows, kind = read_preference_rows(path)
    if kind.endswith("conversational") and tok.chat_template is None:
        raise CorpusError(f"{path}: conversational rows need a chat template, and the tokenizer has none; pass "
                          "--chat-template chatml or a folder with a template")
    eos = tok.id_to_token(tok.eos_token_id) if tok.eos_token_id is not None else None
    if kind.endswith("standard") and eos is None:
        raise CorpusError(f"{path}: text completions get an end-of-sequence token appended, but the tokenizer has none; "
                          "add one or use conversations")
    pairs, dropped, builtin = [], 0, not Path(path).exists()
    for line, row in rows:
        try:
            pair = tokenize_pair(tok, row, eos)
        except LmkitError as exc:
            raise type(exc)(f"{path}:{line}: {exc}") from None
        n = len(pair.prompt_ids)
        if max_prompt_length is not None and n > max_prompt_length:
            raise CorpusError(f"{path}:{line}: the prompt is {n} tokens, more than --max-prompt-length "
                              f"{max_prompt_length}; shorten it, drop the row or raise --max-prompt-length")
        if n >= max_length and builtin:  # rows of the built-in set cannot be edited: left out and counted
            dropped += 1
            continue
        if n >= max_length:
            raise CorpusError(f"{path}:{line}: the prompt is {n} tokens and fills --max-length {max_length}, leaving "
                              "no completion token; raise --max-length, shorten the prompt or drop the row")
        if pair.chosen_ids == pair.rejected_ids:
            raise CorpusError(f"{path}:{line}: chosen and rejected give the same tokens; drop the row or give a "
                              "different rejected answer")
        pairs.append(pair)
    if not pairs:
        raise CorpusError(f"{path}: every prompt fills --max-length {max_length}; raise --max-length")
    return pairs, {"rows": len(rows), "pairs": len(pairs), "dropped": dropped, "format": kind}


def collate_pairs(pairs: list[PreferencePair], pad_id: int, max_length: int | None) -> dict[str, torch.Tensor]:
    """TRL's DataCollatorForPreference: input_ids, attention_mask and completion_mask of the 2n rows (the chosen,
    then the rejected), each cut to max_length keeping its start and right-padded; ref_chosen / ref_rejected when
    precomputed."""
    seqs = [p.prompt_ids + p.chosen_ids for p in pairs] + [p.prompt_ids + p.rejected_ids for p in pairs]
    masks = ([[0] * len(p.prompt_ids) + [1] * len(p.chosen_ids) for p in pairs]
             + [[0] * len(p.prompt_ids) + [1] * len(p.rejected_ids) for p in pairs])
    if max_length is not None:
        seqs, masks = [s[:max_length] for s in seqs], [m[:max_length] for m in masks]
    T = max(len(s) for s in seqs)
    ids = torch.full((len(seqs), T), pad_id, dtype=torch.long)
    attention = torch.zeros((len(seqs), T), dtype=torch.long)
    completion = torch.zeros((len(seqs), T), dtype=torch.long)
    for i, (s, m) in enumerate(zip(seqs, masks)):
        ids[i, :len(s)], attention[i, :len(s)], completion[i, :len(s)] = torch.tensor(s), 1, torch.tensor(m)
    batch = {"input_ids": ids, "attention_mask": attention, "completion_mask": completion}
    if pairs[0].ref_chosen is not None:
        batch["ref_chosen"] = torch.tensor([p.ref_chosen for p in pairs], dtype=torch.float32)
        batch["ref_rejected"] = torch.tensor([p.ref_rejected for p in pairs], dtype=torch.float32)
    return batch
