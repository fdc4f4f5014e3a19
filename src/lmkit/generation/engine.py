"""Continuous batching for decoder-only models: one running batch that requests join and leave between steps.

Each request owns a slot of `SlotCache` (its keys and values, at its own length), its resolved settings, its own
`torch.Generator` and stop criteria. A step admits waiting requests into free slots, prefills prompts in chunks
of at most `prefill_chunk` tokens in all (so a long prompt delays the others by one chunk, not by its length),
then runs one decoding step for every request past its prompt as one batch: new token i attends to its own slot's
keys 0..L_i through a per-row mask, at position L_i. The next token comes from the same per-step core as
`model.generate` (`step.next_scores` and `step.pick`), so greedy and seeded requests give the ids
`model.generate` gives run alone (with torch.manual_seed(seed) before it), whatever else runs beside them.

A `Group` is n requests continuing one prompt as the n rows of `generate(num_return_sequences=n)`: one of them
prefills the prompt and the others copy its keys and values; they share one generator, from which each step draws
every member's token in member order, drawing for finished members too (generate samples its finished rows as well:
torch.multinomial's draws for a row depend on the vocabulary size only), so member j gets row j of generate.

Per step the engine's own Python work stays small beside the model's: greedy rows without score processing take
their tokens from one argmax over the batch (the same ids as a per-row argmax), the decoding plans are built once
per engine (one for a single row, one for several: oneDNN's packed weights give the same products whatever the
number of rows), and the `on_event` calls of a step come together at its end, so that a server waking its
streams from them wakes once per step.
"""
from __future__ import annotations

import threading
import time
from collections import deque
from dataclasses import dataclass, field
from typing import Any, Callable

import torch

from lmkit.device import module_device, place
from lmkit.errors import GenerationError
from lmkit.generation.config import GenerationConfig
from lmkit.generation.processors import CountPenalties
from lmkit.generation.step import Decoding, decoding_for, next_scores, pick
from lmkit.generation.stopping import stop_reached
from lmkit.generation.slots import DecodeView, PrefillView, SlotCache


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
    done: threading.Event = field(default_factory=threading.Event)

    @property
    def finished(self) -> bool:
        return self.finish_reason is not None


@dataclass(eq=False)
class Group:
    """Requests continuing one prompt together as the rows of one `generate(num_return_sequences=n)`."""

    members: list[Request]
    generator: torch.Generator | None = None

    def leader(self) -> Request | None:
        """The member that prefills the prompt for all: the first one not finished."""
        return next((m for m in self.members if not m.finished), None)


def _top(log_probs: torch.Tensor, n: int, chosen: int) -> dict[int, float]:
    """The n likeliest tokens' log-probabilities, and the chosen token's, from the one tensor."""
    top = torch.topk(log_probs, min(n, log_probs.shape[-1])) if n else None
    out = {} if top is None else dict(zip(top.indices.tolist(), top.values.tolist()))
    out.setdefault(chosen, float(log_probs[chosen]))
    return out


class Engine:
    """Runs `Request`s through `model` (a decoder-only CausalLM) `max_batch` at a time; see the module docstring.

    The engine takes the model as it is when it first decodes: change its weights or hooks, or torch's thread
    count, and make a new engine."""

    def __init__(self, model, max_batch: int = 16, prefill_chunk: int = 256, device: str | torch.device | None = None):
        """`device` ("auto", "cpu", "cuda[:N]", "mps"): where the model is moved to run; None: where it is."""
        config = model.config
        if config.architecture != "decoder":
            raise GenerationError(f"the serving engine decodes decoder-only models; this folder is {config.architecture}")
        if any(config.layer_window(i) is not None for i in range(config.n_layers)):
            raise GenerationError("the serving engine does not implement sliding-window attention yet; use generate")
        if max_batch < 1 or prefill_chunk < 1:
            raise GenerationError(f"max_batch and prefill_chunk must be >= 1, got {max_batch} and {prefill_chunk}")
        self.model, self.max_batch, self.prefill_chunk = place(model, device).eval(), max_batch, prefill_chunk
        self.device = module_device(self.model)
        self.cache = SlotCache(max_batch)
        self.free = list(range(max_batch))
        self.waiting: deque[Request] = deque()
        self.running: list[Request] = []
        self.wakeup = threading.Condition()
        self._stopped = False
        self._plans: dict[bool, Any] = {}  # several rows or not -> the model's DecodePlan (None: decode via modules)
        self._events: list[Request] = []  # requests whose on_event is due at the end of this step

    # ---- the public side, safe from any thread --------------------------------------------------
    def prepare(self, request: Request) -> Request:
        """Resolve the request's settings against the model now, so that bad settings raise in the caller."""
        if not request.prompt:
            raise GenerationError("the prompt is empty; give at least one token")
        ids = torch.tensor([request.prompt], device=self.device)
        config = GenerationConfig.build(request.config, max_new_tokens=1) if request.score_only else request.config
        decoding = decoding_for(self.model, ids, None, config, len(request.prompt))
        cfg = decoding.config
        if cfg.num_beams != 1 or cfg.num_return_sequences != 1:
            raise GenerationError("the engine decodes one sequence per request without beams; for n samples "
                                  "prepare n requests as a group (Engine.prepare_group)")
        if decoding.stops and request.tokenizer is None:
            raise GenerationError("stop_strings needs the tokenizer: set Request.tokenizer")
        if request.presence_penalty or request.frequency_penalty:  # the request's own processor, before the config's
            decoding.processors.insert(0, CountPenalties(len(request.prompt), request.presence_penalty,
                                                         request.frequency_penalty))
        decoding.processors[:0] = request.processors  # a grammar's mask before everything else, as generate has it
        request.decoding = decoding
        if cfg.do_sample:
            seed = request.seed if request.seed is not None else int(torch.randint(0, 2 ** 62, ()).item())
            request.generator = torch.Generator(device=self.device).manual_seed(seed)
        return request

    def prepare_group(self, requests: list[Request]) -> list[Request]:
        """Prepare requests with one prompt and one config as the rows of `generate(num_return_sequences=n)` with
        the first one's seed (see the module docstring)."""
        if len(requests) > self.max_batch:
            raise GenerationError(f"n = {len(requests)} sequences of one prompt decode together, more than the "
                                  f"engine's {self.max_batch} slots; lower n (or raise --max-concurrency)")
        if any(r.prompt != requests[0].prompt for r in requests):
            raise GenerationError("a group's requests continue one prompt; give them all the same prompt")
        for request in requests:
            self.prepare(request)
        if len(requests) > 1:
            group = Group(list(requests), requests[0].generator)
            for request in requests:
                request.group, request.generator = group, group.generator
        return requests

    def submit(self, request: Request) -> Request:
        """Queue `request` (with the rest of its group, which joins the batch together)."""
        batch = request.group.members if request.group is not None else [request]
        for member in batch:
            if member.decoding is None:
                self.prepare(member)
        now = time.perf_counter()
        with self.wakeup:
            for member in batch:
                if not member.submitted:
                    member.submitted = now
                    self.waiting.append(member)
            self.wakeup.notify()
        return request

    def cancel(self, request: Request) -> None:
        """Stop `request`; its slot is freed at the next step."""
        request.cancelled = True
        with self.wakeup:
            self.wakeup.notify()

    def counts(self) -> tuple[int, int]:
        """(running, waiting)."""
        return len(self.running), len(self.waiting)

    def run_all(self, requests: list[Request]) -> list[Request]:
        """Submit `requests` and step until every one has finished (no thread needed)."""
        for request in requests:
            self.submit(request)
        while not all(r.finished for r in requests):
            self.step()
        return requests

    def serve_forever(self) -> None:
        """Step while there is work, sleep while there is none, until `shutdown`."""
        while True:
            with self.wakeup:
                while not self._stopped and not self.waiting and not self.running:
                    self.wakeup.wait()
                if self._stopped:
                    return
            self.step()

    def shutdown(self) -> None:
        with self.wakeup:
            self._stopped = True
            self.wakeup.notify()
        for request in list(self.running) + list(self.waiting):
            request.cancelled = True
            self._finish(request, "cancelled")
        self._emit_events()

    # ---- one step -------------------------------------------------------------------------------
    @torch.inference_mode()
    def step(self) -> None:
        for request in [r for r in self.running if r.cancelled]:
            self._finish(request, "cancelled")
        self.running = [r for r in self.running if not r.finished]
        with self.wakeup:
            for request in [r for r in self.waiting if r.cancelled]:
                self.waiting.remove(request)
                self._finish(request, "cancelled")
            while self.waiting:
                group = self.waiting[0].group  # a group joins together
                count = 1
                while group is not None and count < len(self.waiting) and self.waiting[count].group is group:
                    count += 1
                if len(self.free) < count:
                    break
                for _ in range(count):
                    request = self.waiting.popleft()
                    request.slot = self.free.pop(0)
                    self.cache.lengths[request.slot] = 0
                    self.running.append(request)
        budget, fresh = self.prefill_chunk, set()
        for request in self.running:
            if budget == 0:
                break
            if request.prefilled < len(request.prompt) and not request.finished \
                    and (request.group is None or request.group.leader() is request):
                budget -= self._prefill(request, budget)
                fresh.update(id(m) for m in (request.group.members if request.group is not None else [request]))
        decoding = [r for r in self.running if r.output and not r.finished and id(r) not in fresh]
        if decoding:
            self._decode(sorted(decoding, key=lambda r: r.slot))
        self.running = [r for r in self.running if not r.finished]
        self._emit_events()

    def _emit_events(self) -> None:
        events, self._events = self._events, []
        for request in events:
            request.on_event(request)
            if request.finished:
                request.done.set()

    def _prefill(self, request: Request, budget: int) -> int:
        """Feed up to `budget` more prompt tokens; after the last one, choose the first new token."""
        start, prompt = request.prefilled, request.prompt
        end = min(len(prompt), start + budget)
        tokens = torch.tensor([prompt[start:end]], device=self.device)
        positions = torch.arange(start, end, device=self.device)[None]
        keep = 0 if request.prompt_logprobs is not None else 1
        out = self.model(tokens, position_ids=positions, past_key_values=PrefillView(self.cache, request.slot),
                         use_cache=True, logits_to_keep=keep)
        self.cache.lengths[request.slot] = end
        request.prefilled = end
        logits = out.logits[0].float()
        if request.prompt_logprobs is not None:
            self._prompt_logprobs(request, logits, start, end)
        if end == len(prompt):
            members = [request] if request.group is None else [m for m in request.group.members if not m.finished]
            for member in members:
                if member is not request:  # the rest of the group takes the prompt as this request prefilled it
                    self.cache.copy(request.slot, member.slot)
                    member.prefilled = end
                    member.prompt_token_logprobs = list(request.prompt_token_logprobs)
                    member.prompt_top_logprobs = list(request.prompt_top_logprobs)
            if request.score_only:
                for member in members:
                    self._finish(member, "length")
            elif request.group is None:
                self._choose(request, logits[-1:])
            else:
                self._draw_group(request.group, {id(m): logits[-1:].clone() for m in members})
        return end - start

    def _prompt_logprobs(self, request: Request, logits: torch.Tensor, start: int, end: int) -> None:
        """log p(prompt[i] | prompt[:i]) for i in start+1..end-1 from this chunk's logits (the next chunk's first
        token is scored by this chunk's last position)."""
        log_probs = torch.log_softmax(logits, dim=-1)
        if start == 0:
            request.prompt_token_logprobs.append(None)
            request.prompt_top_logprobs.append(None)
        targets = request.prompt[start + 1:end + 1]
        for row, token in enumerate(targets):
            request.prompt_token_logprobs.append(float(log_probs[row, token]))
            request.prompt_top_logprobs.append(_top(log_probs[row], request.prompt_logprobs, token))

    def _decode(self, requests: list[Request]) -> None:
        slots = [r.slot for r in requests]
        view = DecodeView(self.cache, slots, self.device)
        tokens = torch.tensor([[r.output[-1]] for r in requests], device=self.device)
        plan = self._plan(len(requests))
        if plan is not None:
            logits = plan.step(tokens, view, view.lengths[:, None], view.allowed)
        else:
            logits = self.model(tokens, attention_mask=view.allowed, position_ids=view.lengths[:, None],
                                past_key_values=view, use_cache=True, logits_to_keep=1).logits[:, -1]
        for slot in slots:
            self.cache.lengths[slot] += 1
        logits = logits.float()
        plain = [_plain_greedy(r) for r in requests]
        argmax = logits.argmax(-1).tolist() if any(plain) else None
        groups: dict[int, tuple[Group, dict[int, torch.Tensor]]] = {}
        for row, request in enumerate(requests):
            if request.group is None:
                self._choose(request, logits[row:row + 1], argmax[row] if plain[row] else None)
            else:
                groups.setdefault(id(request.group), (request.group, {}))[1][id(request)] = logits[row:row + 1]
        for group, rows in groups.values():
            self._draw_group(group, rows)

    def _draw_group(self, group: Group, rows: dict[int, torch.Tensor]) -> None:
        """Choose the next token of each member of `group` with a row in `rows` (id -> raw logits (1, V)), in member
        order; a finished member's draw is made and dropped, as generate samples its finished rows too."""
        vocab = next(iter(rows.values())).shape[-1]
        for member in group.members:
            logits = rows.get(id(member))
            if logits is not None:
                self._choose(member, logits)
            elif group.generator is not None:
                pick(torch.zeros(1, vocab, device=self.device), True, group.generator)

    def _plan(self, rows: int):
        """The lean one-token step `generate` takes too, where the model has one (None: decode via modules)."""
        several = rows > 1
        if several not in self._plans:
            self._plans[several] = self.model.decode_plan(max(rows, 2) if several else 1)
        return self._plans[several]

    def _choose(self, request: Request, logits: torch.Tensor, token: int | None = None) -> None:
        """Pick the next token of `request` from its raw logits (1, V) (or take `token`, the argmax of a plain
        greedy row), record it and check its stop criteria."""
        decoding, prompt = request.decoding, request.prompt
        if token is None:
            acts = decoding.processors.acts_at(len(prompt) + len(request.output))
            sequence = torch.tensor([prompt + request.output], device=self.device) if acts else None
            scores = next_scores(sequence, logits, decoding)
            token = int(pick(scores, decoding.config.do_sample, request.generator)[0])
        raw = logits
        request.output.append(token)
        if request.logprobs is not None:
            log_probs = torch.log_softmax(raw[0], dim=-1)  # the model's own distribution
            request.token_logprobs.append(float(log_probs[token]))
            request.top_logprobs.append(_top(log_probs, request.logprobs, token))
        skip = request.stop_skip
        if token in decoding.eos or (decoding.stops and len(request.output) > skip
                                     and stop_reached(request.tokenizer, request.output, decoding.stops, skip)):
            self._finish(request, "stop")
        elif len(request.output) >= decoding.max_new_tokens:
            self._finish(request, "length")
        elif request.on_event is not None:
            self._events.append(request)

    def _finish(self, request: Request, reason: str) -> None:
        if request.finished:
            return
        request.finish_reason = reason
        if request.slot is not None:
            self.free.append(request.slot)
            self.free.sort()  # low slots first keeps the batch's rows consecutive more often
        if request.on_event is not None:
            self._events.append(request)  # done is set after the call
        else:
            request.done.set()


def _plain_greedy(request: Request) -> bool:
    """Whether the next token of `request` is the argmax of its raw logits: greedy, and no processor (penalties,
    min_new_tokens's EOS ban ...) changes the scores at this step."""
    decoding = request.decoding
    return not decoding.config.do_sample and not decoding.processors.acts_at(len(request.prompt) + len(request.output))
