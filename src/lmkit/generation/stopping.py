"""When decoding stops: a row at any of its EOS ids (a list, as generation_config.json gives them), or when a stop
criterion holds, and the batch at max_new_tokens or once every row has stopped.

A criterion is checked on each row's ids (prompt + new tokens) after each new token. A per-row one
(`StopStrings`, transformers' StopStringCriteria) finishes that row, which pads from then on; a whole-batch one
(`StopWindow`, lm-eval's MultiTokenEOSCriteria) ends the batch at the first step where every row has met it, the
rows decoding on until then, as transformers treats a criterion that returns one flag for the batch.
"""
from __future__ import annotations

import torch


def stop_reached(tokenizer, new_ids: list[int], stops: list[str], skip: int = 0) -> bool:
    """Whether the text of the new tokens holds one of the stop strings (transformers' StopStringCriteria); with
    `skip`, only a stop that ends past the text of the first `skip` tokens counts (vLLM's min_tokens)."""
    text = tokenizer.decode(new_ids)
    if skip <= 0:
        return any(s in text for s in stops)
    floor = len(tokenizer.decode(new_ids[:skip]))
    return any(text.find(s, max(0, floor - len(s) + 1)) >= 0 for s in stops)


def _ids(row) -> list[int]:
    return row.tolist() if torch.is_tensor(row) else list(row)


class StopCriterion:
    """done(row): whether the row (its ids so far, a list or a 1-D tensor) has met the criterion."""

    whole_batch = False

    def done(self, row) -> bool:
        raise NotImplementedError


class StopStrings(StopCriterion):
    """A row stops once the text of its tokens after the first `start` holds one of `stops`."""

    def __init__(self, tokenizer, stops: list[str], start: int):
        self.tokenizer, self.stops, self.start = tokenizer, stops, start

    def done(self, row) -> bool:
        return stop_reached(self.tokenizer, _ids(row[self.start:]), self.stops)


class StopWindow(StopCriterion):
    """lm-eval's stop rule: a row is done once one of `stops` shows in the decoded text of its last
    len(stop's ids) + 2 columns, none before column `start`; the batch ends when every row is done."""

    whole_batch = True

    def __init__(self, tokenizer, stops: list[str], start: int):
        self.tokenizer, self.start = tokenizer, start
        self.looks: dict[int, list[str]] = {}  # columns looked back over -> the stops looked for in them
        for s in stops:
            self.looks.setdefault(len(tokenizer.encode(s, add_special_tokens=False)) + 2, []).append(s)

    def done(self, row) -> bool:
        for n, group in self.looks.items():  # one decode per look-back, however many stops share it
            text = self.tokenizer.decode(_ids(row[max(self.start, len(row) - n):]))
            if any(s in text for s in group):
                return True
        return False


class Rows:
    """Each row's new tokens and the step the batch ends at, for loops whose rows advance unevenly (prompt lookup):
    a row finishes at an EOS id or a per-row criterion and pads after; the batch ends at the first step where every
    row has finished, or every row has met a whole-batch criterion, or at max_new."""

    def __init__(self, prompts: list[list[int]], eos: list[int], criteria: list[StopCriterion], pad: int, max_new: int):
        self.eos, self.pad, self.max_new = set(eos), pad, max_new
        self.own = [c for c in criteria if not c.whole_batch]
        self.batch = [c for c in criteria if c.whole_batch]
        self.rows = [list(p) for p in prompts]  # what the criteria read
        self.new: list[list[int]] = [[] for _ in prompts]
        self.finished_at: list[int | None] = [None] * len(prompts)
        self.done_at: list[int | None] = [None] * len(prompts)
        self.checked = -1  # steps whose end test has run
        self.end: int | None = None  # the batch's last step, once known

    def push(self, r: int, token: int) -> None:
        step = len(self.new[r])
        if self.finished_at[r] is not None:
            token = self.pad
        self.new[r].append(token)
        self.rows[r].append(token)
        if self.finished_at[r] is None and (token in self.eos or any(c.done(self.rows[r]) for c in self.own)):
            self.finished_at[r] = step
        if self.batch and self.done_at[r] is None and any(c.done(self.rows[r]) for c in self.batch):
            self.done_at[r] = step

    def wanted(self, r: int) -> bool:
        """Whether row r needs the model for its next token."""
        return self.finished_at[r] is None and len(self.new[r]) < self.max_new

    def pad_finished(self) -> None:
        """Finished rows pad up to the longest row, without the model."""
        longest = max(len(n) for n in self.new)
        for r in range(len(self.new)):
            while self.finished_at[r] is not None and len(self.new[r]) < longest:
                self.push(r, self.pad)

    def settle(self) -> bool:
        """Run the end test over the steps every row has reached; whether the batch's end is known."""
        for step in range(self.checked + 1, min(len(n) for n in self.new)):
            self.checked = step
            if all(f is not None and f <= step for f in self.finished_at) or step == self.max_new - 1 or \
                    (self.batch and all(d is not None and d <= step for d in self.done_at)):
                self.end = step
                break
        return self.end is not None

    def columns(self) -> list[list[int]]:
        """Each row's new tokens up to the batch's end."""
        return [n[:self.end + 1] for n in self.new]
