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

import torch

from lmkit.generation.interface import DecodingState
from lmkit.generation.step import Decoding, next_scores
from lmkit.generation.stopping import Rows, StopCriterion


MAX_DRAFT = 8  # most drafted tokens a row (transformers' prompt_lookup_num_tokens is 10)


def speculates(config) -> bool:
    """Whether checking drafts at once gives a decoder plain decoding's numbers: not with sliding windows (the
    holes would count in the window) nor dynamic NTK RoPE (its base follows the furthest position of a
    forward, which a drafted column moves), nor for XLNet, which keeps no KV cache."""
    scaling = config.rope_scaling or {}
    return config.architecture == "decoder" and config.position != "xl" and config.sliding_window is None and \
        scaling.get("rope_type", scaling.get("type")) != "dynamic"


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

    def draft(self, k: int) -> list[int]:
        """k tokens that followed the latest earlier occurrence of the longest matching suffix, or none when no
        suffix occurred before."""
        seq = self.tokens
        if k <= 0:
            return []
        for n in range(min(self.max_n, len(seq)), 0, -1):
            end = self.ends[n].get(tuple(seq[-n:]))
            if end is not None:  # copied as LZ77 copies: a source that runs into the draft repeats it
                draft = seq[end + 1:end + 1 + k]
                while len(draft) < k:
                    draft.append(draft[len(draft) - (len(seq) - end - 1)])
                return draft
        return []


class Speculation:
    """The decoding state of a left-padded batch after its prompt, stepped with drafts: `step(wanted, room)`
    drafts for the rows that still decode, checks them in one forward and returns each row's logits after
    [last token, draft]; the caller chooses, and `keep(kept)` appends the kept tokens (cut from the cache's
    point of view: the rest become holes)."""

    def __init__(self, model, state: DecodingState, prompts: torch.Tensor, first: list[int], pad: int,
                 max_draft: int = MAX_DRAFT, max_n: int = 3):
        """prompts: the (B, T) left-padded prompt ids whose attention mask the state holds; first: each row's
        first new token."""
        self.model, self.state, self.pad, self.max_draft = model, state, pad, max_draft
        mask = state.attention_mask
        state.extra["padded"] = True  # rejected drafts leave holes in the mask: every step passes mask and positions
        state.extra["position"] = (mask.sum(-1) - 1)[:, None]
        rows = [[t for t, m in zip(row, keep) if m] for row, keep in zip(prompts.tolist(), mask.tolist())]
        self.index = [NgramIndex([*p, t], max_n) for p, t in zip(rows, first)]
        self.budget = [min(2, max_draft)] * len(prompts)  # each row's draft length, adapted to what it keeps
        self.drafts: list[list[int]] = []
        self.position = None
        self.k = 1

    def step(self, wanted: list[bool], room: list[int]) -> torch.Tensor:
        """Logits (B, k, V) after each row's last token and draft (k = 1: a plain one-token step). The batch runs
        until its slowest row ends, so a step gains only what every row keeps: drafts are checked when every
        wanted row has one, cut to the shortest. room[r]: how many more tokens row r may take."""
        drafts = [self.index[r].draft(min(self.budget[r], room[r] - 1)) if w else [] for r, w in enumerate(wanted)]
        lengths = [len(d) for d, w in zip(drafts, wanted) if w]
        shortest = min(lengths) if lengths else 0
        self.drafts = [d[:shortest] for d in drafts]
        self.k = k = 1 + shortest
        fed = torch.tensor([[ix.tokens[-1], *d] + [self.pad] * (k - 1 - len(d)) for ix, d in zip(self.index, self.drafts)],
                           dtype=torch.long, device=self.state.attention_mask.device)
        self.position, self.wanted = self.state.extra["position"], wanted
        if k == 1:
            return self.model.generation_logits(self.state, fed)[:, None]
        return self.model.draft_logits(self.state, fed, [1 + len(d) for d in self.drafts])

    def keep(self, kept: list[list[int]]) -> None:
        """Row r's kept tokens: its choices after the first len(kept[r]) fed columns (the first len - 1 draft
        tokens matched); none for a row not wanted."""
        for r, (d, tokens) in enumerate(zip(self.drafts, kept)):
            if d:
                self.budget[r] = next_budget(self.budget[r], len(d), len(tokens) - 1, self.max_draft)
            elif self.budget[r] < 1:
                self.budget[r] += 1
            for t in tokens:
                self.index[r].append(t)
        if self.k > 1 or not all(self.wanted):  # a plain step that every row keeps leaves the state as it is
            keep_columns(self.state, self.position, [len(t) for t in kept], self.k)


def keep_columns(state: DecodingState, position: torch.Tensor, kept: list[int], k: int) -> None:
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


def next_budget(budget: int, drafted: int, kept: int, most: int = MAX_DRAFT) -> int:
    """A row's next draft length after a checked draft: two more after a draft kept whole (up to `most`), one
    more than it kept after one cut short, and after a draft that failed, -7: steps without a draft count it
    back up to a one-token probe, so a row whose drafts fail costs about one drafted column in eight steps."""
    if kept == drafted:
        return min(most, budget + 2)
    return kept + 1 if kept else -7


@torch.inference_mode()
def lookup_greedy(model, input_ids: torch.Tensor, decoding: Decoding, criteria: list[StopCriterion], streamer,
                  num_tokens: int, max_n: int, **model_kwargs) -> torch.Tensor:
    """`generate`'s greedy decoding with prompt_lookup_num_tokens: the same tokens, processors, EOS ids, stop
    criteria, min_new_tokens and padding as the one-token loop (`GenerationMixin._sample`), drafts of up to
    `num_tokens` found from n-grams of up to `max_n` tokens. The batch stops where the one-token loop stops
    (`stopping.Rows`); the output is as wide as the batch ran, finished rows padded."""
    sequences, state = model.prepare_generation(input_ids, decoding.attention_mask, **model_kwargs)
    batch, start = sequences.shape
    max_new = decoding.max_new_tokens
    if streamer is not None:
        streamer.put(sequences.cpu())
    prompts = sequences.tolist()
    rows = Rows(prompts, decoding.eos, criteria, decoding.pad_token_id, max_new)
    # each row's processors read its own context: per-row state (its left padding) cut to the row
    per_row = [decoding.rows(torch.tensor([r], device=sequences.device)) for r in range(batch)]

    def choose(r: int, logits: torch.Tensor, draft: list[int]) -> list[int]:
        """Row r's choices after its fed columns, each on the context before it, while they match the draft."""
        out: list[int] = []
        for j in range(logits.shape[0]):
            context = None
            if decoding.processors.acts_at(start + len(rows.new[r])):
                context = torch.tensor([rows.rows[r]], device=sequences.device)
            token = int(next_scores(context, logits[j:j + 1], per_row[r]).argmax(-1))
            out.append(token)
            rows.push(r, token)
            if rows.finished_at[r] is not None or len(rows.new[r]) >= max_new or j >= len(draft) or draft[j] != token:
                break
        return out

    def advance(kept: list[list[int]]) -> None:
        if streamer is not None and kept[0]:
            streamer.put(torch.tensor(kept[0]))
        rows.pad_finished()

    first = [choose(r, row[None], []) for r, row in enumerate(model.generation_logits(state, sequences))]
    advance(first)
    spec = Speculation(model, state, sequences, [f[0] for f in first], decoding.pad_token_id, max_draft=num_tokens,
                       max_n=max_n)
    while not rows.settle():
        wanted = [rows.wanted(r) for r in range(batch)]
        logits = spec.step(wanted, [max_new - len(n) for n in rows.new])
        kept = [choose(r, logits[r], spec.drafts[r]) if wanted[r] else [] for r in range(batch)]
        spec.keep(kept)
        advance(kept)
    if streamer is not None:
        streamer.end()
    columns = rows.columns()
    out = sequences.new_full((batch, start + len(columns[0])), decoding.pad_token_id)
    out[:, :start] = sequences
    out[:, start:] = torch.tensor(columns, dtype=out.dtype, device=out.device)
    return out
