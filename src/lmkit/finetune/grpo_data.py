"""GRPO's prompts: JSONL rows as TRL's GRPOTrainer reads them, or the built-in verifiable task.

A row is {"prompt": text} or {"prompt": [messages]} (conversational: rendered with the chat template and the
assistant's generation prompt, as TRL renders it); every other key is a column that the reward functions receive
(as TRL passes them: one list per column, each row's value repeated for its G completions).

`addition-cot`: the harness's addition problems (1 to 4 digits, up to 500 each, its test problems left out: 1550
in all) as zero-shot prompts
"Question: 15+27\\nAnswer:" with the column answer "42", checked by the built-in reward `exact-answer` on the
number after "The answer is" (the strict-match filter of addition_cot_d*); a completion ends at its first line break.
"""
from __future__ import annotations

import json
import random
from pathlib import Path

from lmkit.errors import ConfigError

BUILTIN_PROMPTS = ("addition-cot",)
ADDITION_DIGITS = (1, 2, 3, 4)
ADDITION_PER_DIGITS = 500
ADDITION_STOP = ("\n",)


def addition_prompts(per_digits: int = ADDITION_PER_DIGITS, seed: int = 0,
                     digits: tuple[int, ...] = ADDITION_DIGITS) -> list[dict]:
    """Seeded addition problems outside the harness's test sets, shuffled across digit counts."""
    from lmkit.evaluate.harness_tasks.lmkit_tasks import addition_problems, addition_splits

    rng = random.Random(f"grpo-addition-{seed}")
    rows = []
    for d in digits:
        held = set(addition_splits(d)[0])
        for a, b in addition_problems(d, per_digits, rng, avoid=held):
            rows.append({"prompt": f"Question: {a}+{b}\nAnswer:", "answer": str(a + b), "digits": d})
    rng.shuffle(rows)
    return rows


def read_prompts(source: str) -> list[dict]:
    """The rows of a prompts JSONL file (or a built-in task's); a ConfigError naming the file and line of a bad row."""
    if source == "addition-cot":
        return addition_prompts()
    path = Path(source)
    if not path.is_file():
        raise ConfigError(f"--prompts {source}: no such file; give a .jsonl file of {{\"prompt\": ...}} rows or one of "
                          f"{', '.join(BUILTIN_PROMPTS)}")
    rows = []
    try:
        lines = path.read_text(encoding="utf-8").splitlines()
    except UnicodeDecodeError as exc:
        raise ConfigError(f"{path} is not UTF-8 text ({exc.reason} at byte {exc.start}); save it as UTF-8") from None
    for number, line in enumerate(lines, 1):
        if not line.strip():
            continue
        try:
            row = json.loads(line)
        except json.JSONDecodeError as exc:
            raise ConfigError(f"{path}:{number}: not JSON ({exc.msg}); write one JSON object per line") from None
        prompt = row.get("prompt") if isinstance(row, dict) else None
        conversational = isinstance(prompt, list) and all(isinstance(m, dict) and "role" in m and "content" in m
                                                          for m in prompt) and prompt
        if not (isinstance(prompt, str) and prompt) and not conversational:
            raise ConfigError(f"{path}:{number}: a row needs \"prompt\": a non-empty text or a list of "
                              "{\"role\", \"content\"} messages")
        if rows and isinstance(prompt, str) != isinstance(rows[0]["prompt"], str):
            raise ConfigError(f"{path}:{number}: mixes text and conversational prompts; give all rows one kind")
        rows.append(row)
    if not rows:
        raise ConfigError(f"{path} holds no rows; give one {{\"prompt\": ...}} object per line")
    return rows


def prompt_ids(tokenizer, rows: list[dict], source: str, max_prompt_length: int | None) -> list[list[int]]:
    """Token ids of each row's prompt as TRL tokenizes it: text with the tokenizer's special tokens, messages through
    the chat template with the generation prompt; a ConfigError naming the row of a prompt beyond max_prompt_length."""
    conversational = isinstance(rows[0]["prompt"], list)
    if conversational and tokenizer.chat_template is None:
        raise ConfigError(f"{source} holds conversational prompts and the model has no chat template; give text "
                          "prompts or a model folder with a chat template")
    out = []
    for number, row in enumerate(rows, 1):
        if conversational:
            ids = tokenizer.apply_chat_template(row["prompt"], add_generation_prompt=True, tokenize=True)
            ids = ids["input_ids"] if isinstance(ids, dict) else ids
        else:
            ids = tokenizer.encode(row["prompt"])
        if max_prompt_length is not None and len(ids) > max_prompt_length:
            raise ConfigError(f"{source} row {number}: the prompt is {len(ids)} tokens, more than --max-prompt-length "
                              f"{max_prompt_length}; shorten it or raise --max-prompt-length")
        out.append(list(ids))
    return out
