"""What the engine schedules: a `Request` (one sequence to continue, with the fields the engine writes as it goes)
and a `Group` (n requests continuing one prompt as the rows of `generate(num_return_sequences=n)`)."""
from __future__ import annotations

import threading
from dataclasses import dataclass, field
from typing import Any, Callable

import torch

from lmkit.generation.config import GenerationConfig
from lmkit.generation.step import Decoding, pick


@dataclass
class Request:
    """One sequence to continue. The engine fills the fields below the line and calls `on_event(request)` (in its
    thread) after each new token and once more when the request finishes."""

    prompt: list[int]
    config: GenerationConfig = field(default_factory=GenerationConfig)
    seed: int | None = None
    tokenizer: Any = None  # decodes the output for stop strings
    logprobs: int | None = None  # this many alternatives per new token (0: the chosen token's log-probability only)
    prompt_logprobs: int | None = None  # the same for each prompt token after the first
    score_only: bool = False  # prefill and score the prompt, generate nothing
    presence_penalty: float = 0.0  # OpenAI's penalties over the output's tokens (processors.CountPenalties)
    frequency_penalty: float = 0.0
    stop_skip: int = 0  # stop strings count only where they end past the first stop_skip new tokens (vLLM's min_tokens)
    processors: list = field(default_factory=list)  # the request's own logits processors (a grammar), applied first
    on_event: Callable[["Request"], None] | None = None
    group: "Group | None" = None  # set by Engine.prepare_group
    adapter: str | None = None  # the LoRA adapter the request decodes with (Engine.adapters), None: the base model
    # ---- written by the engine
    output: list[int] = field(default_factory=list)
    token_logprobs: list[float] = field(default_factory=list)
    top_logprobs: list[dict[int, float]] = field(default_factory=list)
    prompt_token_logprobs: list[float | None] = field(default_factory=list)
    prompt_top_logprobs: list[dict[int, float] | None] = field(default_factory=list)
    finish_reason: str | None = None  # "stop" (EOS or a stop string), "length", "cancelled"
    submitted: float = 0.0
    cancelled: bool = False
    decoding: Decoding | None = None
    generator: torch.Generator | None = None
    slot: int | None = None
    prefilled: int = 0
    cached_tokens: int = 0  # prompt tokens whose keys and values came from the prefix cache
    decoder_prompt: list[int] | None = None  # an encoder-decoder's: what its output continues (the prompt is the source)
    beams: list[list[int]] | None = None  # with num_beams > 1: the num_return_sequences best hypotheses, best first
    done: threading.Event = field(default_factory=threading.Event)

    @property
    def finished(self) -> bool:
        return self.finish_reason is not None

    @property
    def plain_greedy(self) -> bool:
        """Whether the next token is the argmax of the raw logits: greedy, and no processor (penalties,
        min_new_tokens's EOS ban ...) changes the scores at this step."""
        decoding = self.decoding
        return not decoding.config.do_sample and not decoding.processors.acts_at(len(self.history) + len(self.output))

    @property
    def history(self) -> list[int]:
        """The ids the output continues: the prompt, or an encoder-decoder's decoder prompt."""
        return self.prompt if self.decoder_prompt is None else self.decoder_prompt


@dataclass(eq=False)
class Group:
    """Requests continuing one prompt together, as the rows of one `generate(num_return_sequences=n)` (sharing one
    generator: member j gets row j of generate) or of one beam search (`search`): one of them prefills the prompt
    and the others copy its keys and values."""

    members: list[Request]
    generator: torch.Generator | None = None
    search: Any = None  # with beams: the engine_beams.BeamRun that drives the members (rows), else None
    uniform: bool = field(init=False)  # every member has the same settings and no processor of its own

    def __post_init__(self):
        first = self.members[0]
        self.uniform = all(r.config == first.config and not r.processors and not r.presence_penalty
                           and not r.frequency_penalty for r in self.members)

    def step(self, engine, logits: torch.Tensor, rows: dict[int, int]) -> None:
        """Choose the next token of each member with a row of raw `logits` (rows: id -> row) in `engine`: a beam
        search's step (`search`), else each greedy member's own argmax, or sampled members in one (members, V)
        draw from the group's generator, which draws row j as the j-th of member-by-member draws would (torch's
        draws for a row depend on the vocabulary size only); a finished member's row is uniform, drawn and
        dropped, as generate samples its finished rows too (scored as one block where `block_scores` can)."""
        if self.search is not None:
            self.search.step(engine, {key: logits[row:row + 1] for key, row in rows.items()})
        elif self.generator is None:
            for member in self.members:
                if id(member) in rows:
                    engine._choose(member, logits[rows[id(member)]:rows[id(member)] + 1])
        else:
            scores = self.block_scores(logits, rows)
            if scores is None:
                scores = torch.cat([engine._scores(m, logits[rows[id(m)]:rows[id(m)] + 1]) if id(m) in rows
                                    else torch.zeros(1, logits.shape[-1], device=engine.device) for m in self.members])
            tokens = pick(scores, True, self.generator).tolist()
            for member, token in zip(self.members, tokens):
                row = rows.get(id(member))
                if row is not None:  # the raw row only where the member reports log-probabilities
                    engine._choose(member, logits[row:row + 1] if member.logprobs is not None else None, token)

    def leader(self) -> Request | None:
        """The member that prefills the prompt for all: the first one not finished."""
        return next((m for m in self.members if not m.finished), None)

    def block_scores(self, logits: torch.Tensor, rows: dict[int, int]) -> torch.Tensor | None:
        """The processed scores (members, V) of the next tokens from the raw `logits` of the members with a row
        (rows: id -> row; the others, finished, get a uniform row), processed as one block as generate processes
        its rows, where the members share their settings and no processor reads the sequences at this step
        (each processor acts on each row alone); None where not."""
        present = [j for j, m in enumerate(self.members) if id(m) in rows]
        leader = self.members[present[0]]  # the members left decode in step: one length
        length = len(leader.history) + len(leader.output)
        processors = leader.decoding.processors
        if not self.uniform or any(getattr(p, "reads_ids", True) and p.acts_at(length) for p in processors):
            return None
        index = [rows[id(self.members[j])] for j in present]
        block = logits[index[0]:index[-1] + 1] if index == list(range(index[0], index[-1] + 1)) else logits[index]
        for processor in processors:
            if processor.acts_at(length):
                block = processor(None, block)
        if len(present) == len(self.members):
            return block
        return block.new_zeros(len(self.members), block.shape[-1]).index_copy_(
            0, torch.tensor(present, device=block.device), block)
