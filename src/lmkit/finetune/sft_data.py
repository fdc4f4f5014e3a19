"""Supervised fine-tuning data as TRL's SFTTrainer prepares it: rows -> (input_ids, labels), truncation, packing.

Row formats (JSONL, one per line; every row of a file in the same format):
    {"text": ...}                                   language modelling: every token trained, EOS appended
    {"prompt": ..., "completion": ...}              text, or lists of messages (conversational prompt/completion)
    {"messages": [{"role": ..., "content": ...}]}   a conversation, rendered by the tokenizer's chat template
Labels are the input ids with -100 where no loss is taken: prompt tokens (completion-only loss) and everything outside
the template's `{% generation %}` blocks (assistant-only loss), unless `train_on_all`. The prompt ends where the
tokens of the prompt alone and of prompt + completion diverge (TRL's common prefix).

Packing puts whole examples into rows of at most max_length tokens by best-fit decreasing (an example goes to the
fullest row it fits in; longer examples are cut to max_length, and, as in TRL, kept even when the cut leaves them no
trained token); position ids restart at 0 in every example, and the
label of each example's first token is -100 so nothing is learnt across the seam.
"""
from __future__ import annotations

import bisect
import json
from collections import defaultdict, deque
from dataclasses import dataclass, field
from pathlib import Path

from lmkit.data.instruct import pydocs_instruct
from lmkit.errors import CorpusError, LmkitError

ROLES = ("system", "user", "assistant", "tool", "developer")
PACK_CHUNK = 1000  # TRL packs each batch of 1000 examples of datasets.map on its own


@dataclass
class SFTExample:
    input_ids: list[int]
    labels: list[int]
    seq_lengths: list[int] = field(default_factory=list)  # lengths of the examples packed into this row

    def position_ids(self) -> list[int]:
        lengths = self.seq_lengths or [len(self.input_ids)]
        return [i for n in lengths for i in range(n)]


def read_rows(path) -> list[tuple[int, dict]]:
    """[(line number, row)] of a JSONL file of SFT rows, each checked; a CorpusError names the file and line.
    The built-in `pydocs-instruct` (its train split; `pydocs-instruct:validation` for the other) reads as a file."""
    if str(path).startswith("pydocs-instruct") and not Path(path).exists():

        split = str(path).partition(":")[2] or "train"
        return [(i + 1, {"messages": r["messages"]}) for i, r in enumerate(pydocs_instruct(split))]
    path = Path(path)
    try:
        raw = path.read_bytes()
    except OSError as exc:
        raise CorpusError(f"cannot read {path}: {exc.strerror or exc}") from None
    rows, kind = [], None
    for n, line in enumerate(raw.split(b"\n"), start=1):
        if not line.strip():
            continue
        where = f"{path}:{n}"
        try:
            text = line.decode("utf-8")
        except UnicodeDecodeError as exc:
            raise CorpusError(f"{where}: bytes that are not UTF-8 (at byte {exc.start}); re-save the file as UTF-8") from None
        try:
            row = json.loads(text)
        except ValueError as exc:
            raise CorpusError(f"{where}: not a JSON object ({exc.msg}); write one JSON object per line") from None
        this = row_format(row, where)
        if kind is not None and this != kind:
            raise CorpusError(f"{where}: a {this!r} row in a file of {kind!r} rows; use one format per file")
        kind = this
        rows.append((n, row))
    if not rows:
        raise CorpusError(f"{path} holds no rows; write one JSON object per line ({{\"messages\": [...]}}, "
                          "{\"prompt\", \"completion\"} or {\"text\"})")
    return rows


def row_format(row, where: str) -> str:
    """"text", "prompt_completion", "messages" or "conversational_prompt_completion", after checking the row."""
    if not isinstance(row, dict):
        raise CorpusError(f"{where}: a row is a JSON object, not {type(row).__name__}")
    if "messages" in row:
        _check_messages(row["messages"], where, "messages")
        return "messages"
    if "prompt" in row or "completion" in row:
        for key in ("prompt", "completion"):
            if key not in row:
                raise CorpusError(f"{where}: a prompt/completion row needs both \"prompt\" and \"completion\"")
        p, c = row["prompt"], row["completion"]
        if isinstance(p, str) and isinstance(c, str):
            if not c:
                raise CorpusError(f"{where}: the completion is empty; give the answer to train on")
            return "prompt_completion"
        if isinstance(p, list) and isinstance(c, list):
            _check_messages(p, where, "prompt")
            _check_messages(c, where, "completion")
            return "conversational_prompt_completion"
        raise CorpusError(f"{where}: prompt and completion are both strings or both lists of messages")
    if "text" in row:
        if not isinstance(row["text"], str) or not row["text"]:
            raise CorpusError(f"{where}: \"text\" must be a non-empty string")
        return "text"
    raise CorpusError(f"{where}: a row needs \"messages\", \"prompt\" and \"completion\", or \"text\" "
                      f"(found {sorted(row)[:5]})")


def _check_messages(messages, where: str, key: str) -> None:
    if not isinstance(messages, list) or not messages:
        raise CorpusError(f"{where}: \"{key}\" must be a non-empty list of {{\"role\", \"content\"}} messages")
    for i, m in enumerate(messages):
        if not isinstance(m, dict) or "role" not in m:
            raise CorpusError(f"{where}: {key}[{i}] needs a \"role\" and a \"content\"")
        if m["role"] not in ROLES:
            raise CorpusError(f"{where}: {key}[{i}] has the unknown role {m['role']!r}; use one of {', '.join(ROLES)}")
        content = m.get("content")
        if content is not None and not isinstance(content, (str, list)):
            raise CorpusError(f"{where}: {key}[{i}] content must be a string")
        if "content" not in m and not m.get("tool_calls"):
            raise CorpusError(f"{where}: {key}[{i}] has no \"content\"")
        if m["role"] == "assistant" and not content and not m.get("tool_calls"):
            raise CorpusError(f"{where}: {key}[{i}] is an empty assistant turn; give the reply to train on")


def _common_prefix(a: list[int], b: list[int]) -> int:
    n = 0
    for x, y in zip(a, b):
        if x != y:
            break
        n += 1
    return n


def tokenize_row(tok, row: dict, kind: str, train_on_all: bool = False, eos_token: str | None = None) -> SFTExample:
    """(input_ids, labels) of one checked row, as SFTTrainer's tokenize and build_labels steps make them."""
    assistant_only = not train_on_all
    if kind == "text":
        text = row["text"]
        if eos_token and not text.endswith(eos_token):
            text += eos_token
        ids = tok.encode(text)
        return SFTExample(ids, list(ids))
    if kind == "prompt_completion":
        completion = row["completion"]
        if eos_token and not completion.endswith(eos_token):
            completion += eos_token
        prompt_ids = tok.encode(row["prompt"])
        ids = tok.encode(row["prompt"] + completion)
        start = _common_prefix(prompt_ids, ids) if not train_on_all else 0
        return SFTExample(ids, [-100] * start + ids[start:])
    tools = row.get("tools")
    tools = json.loads(tools) if isinstance(tools, str) else tools
    extra = dict(row.get("chat_template_kwargs") or {})
    if kind == "messages":
        out = tok.apply_chat_template(row["messages"], tools=tools, return_dict=True,
                                      return_assistant_tokens_mask=assistant_only, **extra)
        ids = out["input_ids"]
        keep = out.get("assistant_masks") or [1] * len(ids)
    else:
        prompt_ids = tok.apply_chat_template(row["prompt"], tools=tools, add_generation_prompt=True, return_dict=True,
                                             **extra)["input_ids"]
        out = tok.apply_chat_template(row["prompt"] + row["completion"], tools=tools, return_dict=True,
                                      return_assistant_tokens_mask=assistant_only, **extra)
        ids = out["input_ids"]
        start = 0 if train_on_all else _common_prefix(prompt_ids, ids)
        keep = [int(i >= start and (m if assistant_only else 1))
                for i, m in enumerate(out.get("assistant_masks") or [1] * len(ids))]
    if assistant_only and 1 not in keep:
        raise CorpusError("the chat template marks no assistant tokens (it needs {% generation %} blocks); use "
                          "--chat-template chatml, a template with generation blocks, or train on every token")
    return SFTExample(ids, [t if k else -100 for t, k in zip(ids, keep)])


def prepare(tok, path, max_length: int, train_on_all: bool = False, packing: bool = False) -> tuple[list[SFTExample], dict]:
    """Examples of a JSONL file ready to batch, and a report. Errors name the file and the line.

    As TRL's SFTTrainer: without packing, rows are cut to max_length and those left with no trained token are dropped
    (report["dropped"]); with packing, every row goes into the bins whole (the packer cuts it to max_length) and
    those with no trained token within it stay as context-free filler: counted in report["untrained"], not dropped."""

    rows = read_rows(path)
    eos = tok.id_to_token(tok.eos_token_id) if tok.eos_token_id is not None else None
    kind = row_format(rows[0][1], f"{path}:{rows[0][0]}")
    if kind in ("text", "prompt_completion") and eos is None:
        raise CorpusError(f"{path}: text rows get an end-of-sequence token appended, but the tokenizer has none; "
                          "add one (tok.add_special_tokens) or use conversations")
    examples, untrained = [], 0
    for line, row in rows:
        try:
            ex = tokenize_row(tok, row, kind, train_on_all, eos)
        except LmkitError as exc:
            raise type(exc)(f"{path}:{line}: {exc}") from None
        if all(label == -100 for label in ex.labels[:max_length]):
            untrained += 1
            if not packing:
                continue
        examples.append(ex if packing else SFTExample(ex.input_ids[:max_length], ex.labels[:max_length]))
    if untrained == len(rows):
        raise CorpusError(f"{path}: no row has a trained token within --max-length {max_length}; raise --max-length")
    report = {"rows": len(rows), "dropped": 0 if packing else untrained, "examples": len(examples), "format": kind}
    if packing:
        examples = pack_bfd(examples, max_length)
        report.update(packed_rows=len(examples), untrained=untrained)
    return examples, report


def pack_bfd(examples: list[SFTExample], max_length: int, chunk: int = PACK_CHUNK) -> list[SFTExample]:
    """Best-fit-decreasing packing of each chunk of `chunk` examples into rows of at most max_length tokens."""
    out = []
    for start in range(0, len(examples), chunk):
        out += _pack_chunk(examples[start:start + chunk], max_length)
    return out


def _pack_chunk(examples: list[SFTExample], max_length: int) -> list[SFTExample]:
    cut = [SFTExample(e.input_ids[:max_length], e.labels[:max_length]) for e in examples if e.input_ids]
    order = sorted(range(len(cut)), key=lambda i: -len(cut[i].input_ids))  # stable: ties keep their order
    spaces: list[int] = []  # sorted free spaces < max_length that some row has
    by_space: dict[int, deque] = defaultdict(deque)
    bins: list[list[int]] = []
    for i in order:
        n = len(cut[i].input_ids)
        at = bisect.bisect_left(spaces, n)
        if at < len(spaces):  # the row with the least room that still fits (the oldest of those)
            space = spaces[at]
            row = by_space[space].popleft()
            if not by_space[space]:
                spaces.pop(at)
        else:
            space, row = max_length, []
            bins.append(row)
        row.append(i)
        left = space - n
        if left > 0:
            if not by_space[left]:
                bisect.insort(spaces, left)
            by_space[left].append(row)
    packed = []
    for row in bins:
        ids, labels, lengths = [], [], []
        for i in row:
            ids += cut[i].input_ids
            labels += [-100] + cut[i].labels[1:]  # no loss on the seam between two examples
            lengths.append(len(cut[i].input_ids))
        packed.append(SFTExample(ids, labels, lengths))
    return packed
