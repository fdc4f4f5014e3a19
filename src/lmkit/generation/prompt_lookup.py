"""Prompt-lookup speculation for greedy decoding (Saxena's prompt lookup decoding, transformers'
`prompt_lookup_num_tokens`, vLLM's n-gram speculator): the tokens that followed the latest earlier occurrence of
a row's last n tokens are its draft, and one forward over [last token, draft] checks them all. Draft token j is
kept while every token before it equals the greedy choice there, so the tokens kept are exactly greedy
decoding's, one to len(draft) + 1 of them per forward. Copying from the prompt is what few-shot and
chain-of-thought continuations do (numbers, names and phrasing of the exemplars come back), and a model that
repeats itself drafts its own repetition.

Rows of a batch keep different numbers of tokens; the cache keeps every column it was given, and the columns
of rejected drafts are masked out of the attention mask (holes), with each row's positions counting its kept
tokens only, so every kept token sees the keys and positions of plain decoding.
"""
from __future__ import annotations

from typing import TYPE_CHECKING

import torch

from lmkit.nn import build_attention_bias

if TYPE_CHECKING:
    from lmkit.generation.mixin import DecodingState


class NgramIndex:
    """For n = 1..max_n, the latest end e of each n-gram of `tokens` that has a token after it (e < len - 1)."""

    def __init__(self, tokens: list[int], max_n: int = 3):
        self.tokens = list(tokens)
        self.max_n = max_n
        # a later end overwrites an earlier one: the latest is kept
        self.ends: list[dict[tuple, int]] = [{}] + [
            {tuple(tokens[e - n + 1:e + 1]): e for e in range(n - 1, len(tokens) - 1)} for n in range(1, max_n + 1)]

    def append(self, token: int) -> None:
        seq, last = self.tokens, len(self.tokens) - 1
        for n in range(1, min(self.max_n, last + 1) + 1):  # the n-grams ending at the old last token now have a next
            self.ends[n][tuple(seq[last - n + 1:last + 1])] = last
        seq.append(token)

    def draft(self, k: int, min_n: int = 1) -> list[int]:
        """k tokens that followed the latest earlier occurrence of the longest matching suffix (n >= min_n), or
        none when no suffix occurred before."""
        seq = self.tokens
        if k <= 0:
            return []
        for n in range(min(self.max_n, len(seq)), min_n - 1, -1):
            end = self.ends[n].get(tuple(seq[-n:]))
            if end is not None:  # copied as LZ77 copies: a source that runs into the draft repeats it
                draft = seq[end + 1:end + 1 + k]
                while len(draft) < k:
                    draft.append(draft[len(draft) - (len(seq) - end - 1)])
                return draft
        return []


def verify_drafts(model, state: "DecodingState", fed: torch.Tensor, used: torch.Tensor) -> torch.Tensor:
    """Greedy choices (B, k) after each column of `fed` (B, k): each row's pending last token, then its draft,
    the first used[r] columns, then padding (anything). Appends the k columns to the cache and the mask; `keep_columns` then masks the
    rejected ones. The state is a padded one (its mask and per-row `position`, as after `prefill_unpadded`)."""
    k = fed.shape[1]
    mask = torch.cat([state.attention_mask, state.attention_mask.new_ones(fed.shape[0], k)], dim=1)
    # a short draft's padding columns become holes; they take the first column's position, so that none lies
    # past the positions the real columns reach (a learned table ends)
    steps = torch.arange(k, device=fed.device)[None, :]
    positions = state.extra["position"] + 1 + steps.masked_fill(steps >= used.to(fed.device)[:, None], 0)
    plan = state.extra.get("plan", False)
    if plan is False:
        plan = state.extra["plan"] = model._decode_plan(fed.shape[0])
    if plan is not None:  # the lean step, k tokens a row, causal among them
        past = state.cache.get_seq_length()
        bias, _ = build_attention_bias(mask, fed.shape[0], k, past + k, True, torch.bool, fed.device)
        logits = plan.step(fed, state.cache, positions, bias)
    else:
        logits = model(fed, attention_mask=mask, position_ids=positions, past_key_values=state.cache,
                       use_cache=True).logits
    state.attention_mask = mask
    return logits.argmax(-1)


def keep_columns(state: "DecodingState", position: torch.Tensor, kept: list[int], k: int) -> None:
    """After a step that appended k columns: row r keeps the first kept[r] of them (the rest become holes), and
    its position moves on from `position` (the rows' positions before the step) by kept[r]."""
    mask = state.attention_mask
    start = mask.shape[1] - k
    kept_t = torch.tensor(kept, device=mask.device)
    columns = torch.arange(k, device=mask.device)
    mask[:, start:] = (columns[None, :] < kept_t[:, None]).to(mask.dtype)
    state.extra["position"] = position + kept_t[:, None]


def accepted(draft: list[int], choices: list[int]) -> int:
    """How many greedy choices one verification gives a row: 1 + the draft tokens that match the choices
    before them."""
    n = 0
    while n < len(draft) and draft[n] == choices[n]:
        n += 1
    return n + 1


MAX_DRAFT = 8  # most drafted tokens a row (transformers' prompt_lookup_num_tokens is 10)


def next_budget(budget: int, drafted: int, kept: int | None) -> int:
    """A row's next draft length: two more after a draft kept whole, one more than it kept after one cut short,
    and after a step without a draft, a probe of one token once the budget has recovered (steps without drafts
    count up from a negative budget), so a row whose drafts fail costs about one drafted column in eight steps."""
    if kept is None:  # no draft this step: no earlier occurrence, or a budget below one
        return budget + 1 if budget < 1 else budget
    if kept == drafted:
        return min(MAX_DRAFT, budget + 2)
    return kept + 1 if kept else -7
