"""Continuous batching: one running batch that requests join and leave between steps (docs/serving.md).

Each request owns a slot of `SlotCache` (its keys and values, at its own length), its resolved settings, its own
`torch.Generator` and stop criteria. A step admits waiting requests into free slots and spends a budget of
`prefill_chunk` tokens as vLLM's chunked prefill does: one for each running stream's next token, what is left on
chunks of waiting prompts (so arrivals lengthen a running stream's step by at most the budget, not by their
prompts' length). It prefills those chunks, then runs one decoding step for every request past its prompt as one
batch: new token i attends to its own slot's keys 0..L_i through a per-row mask (and, in a layer sliding over W,
keys past L_i - W only), at position L_i. An encoder-decoder's request is admitted by generate's own first step
(`cross_attention.py`: the source encoded once, its cross-attention keys and values kept with the slot). The next
token comes from the same per-step core as `model.generate` (`step.next_scores` and `step.pick`), so greedy and
seeded requests give the ids `model.generate` gives run alone (with torch.manual_seed(seed) before it), whatever
else runs beside them; a `Group` (requests.py) gives the rows of `generate(num_return_sequences=n)`.
Per step, greedy rows without score processing take their tokens from one argmax over the batch, the decoding
plans are built once per engine, and the `on_event` calls of a step come together at its end.
"""
from __future__ import annotations

import threading
import time
from collections import deque
from typing import Any, Callable

import torch

from lmkit.device import module_device, place
from lmkit.errors import GenerationError
from lmkit.generation.config import GenerationConfig
from lmkit.generation.cross_attention import EncoderDecoderRows
from lmkit.generation.engine_beams import beam_group
from lmkit.generation.logprobs import record_prompt_logprobs, top_logprobs
from lmkit.generation.lora_rows import Adapters, Weights
from lmkit.generation.prefix_cache import PrefixCache
from lmkit.generation.processors import CountPenalties
from lmkit.generation.requests import Group, Request  # noqa: F401  (the engine's public names)
from lmkit.generation.step import decoding_for, next_scores, pick
from lmkit.generation.stopping import stop_reached
from lmkit.generation.slots import DecodeView, SlotCache, prefill_logits


class Engine:
    """Runs `Request`s through `model` (decoder-only or encoder-decoder) `max_batch` at a time; see the module docstring.

    The engine takes the model as it is when it first decodes: change its weights or hooks, or torch's thread
    count, and make a new engine."""

    def __init__(self, model, max_batch: int = 16, prefill_chunk: int = 2048, device: str | torch.device | None = None,
                 cache_memory: int = 0):
        """`device` ("auto", "cpu", "cuda[:N]", "mps"): where the model is moved to run; None: where it is.
        `cache_memory`: bytes of keys and values the prefix cache keeps for later requests (0: no prefix caching)."""
        config = model.config
        if config.architecture not in ("decoder", "encoder-decoder"):
            raise GenerationError(f"the serving engine decodes decoder-only and encoder-decoder models; this folder is "
                                  f"{config.architecture}")
        if max_batch < 1 or prefill_chunk < 1:
            raise GenerationError(f"max_batch and prefill_chunk must be >= 1, got {max_batch} and {prefill_chunk}")
        self.model, self.max_batch, self.prefill_chunk = place(model, device).eval(), max_batch, prefill_chunk
        self.device = module_device(self.model)
        self.windows = {config.layer_window(i) for i in range(config.n_layers)} - {None}  # sliding layers' windows
        self.cache = SlotCache(max_batch)
        seq2seq = config.architecture == "encoder-decoder"
        self.seq2seq = EncoderDecoderRows(self.model, max_batch) if seq2seq else None
        self.prefix = PrefixCache(self.model, cache_memory) if cache_memory and not seq2seq else None
        self.adapters = Adapters(self.model)
        self._model_lock = threading.Lock()  # held by a step, and by adding or removing an adapter
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
        start = self.model.generation_prompt_length(ids, {})  # the prompt, or an encoder-decoder's decoder prompt
        decoding = decoding_for(self.model, ids, None, config, start)
        cfg = decoding.config
        if self.seq2seq is not None:
            self.seq2seq.check(request)
        if cfg.num_beams == 1 and cfg.num_return_sequences != 1:
            raise GenerationError("for n samples prepare n requests as a group (Engine.prepare_group)")
        if request.adapter is not None and request.adapter not in self.adapters.names:
            raise GenerationError(f"no adapter named {request.adapter!r} is loaded; load it first (add_adapter)")
        if decoding.stops and request.tokenizer is None:
            raise GenerationError("stop_strings needs the tokenizer: set Request.tokenizer")
        if request.presence_penalty or request.frequency_penalty:  # the request's own processor, before the config's
            decoding.processors.insert(0, CountPenalties(start, request.presence_penalty,
                                                         request.frequency_penalty))
        decoding.processors[:0] = request.processors  # a grammar's mask before everything else, as generate has it
        request.decoding = decoding
        if cfg.do_sample:
            seed = request.seed if request.seed is not None else int(torch.randint(0, 2 ** 62, ()).item())
            request.generator = torch.Generator(device=self.device).manual_seed(seed)
        if cfg.num_beams > 1:
            beam_group(request, self.max_batch)
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
            if request.decoding.config.num_beams > 1:
                raise GenerationError("a beam search is one request whose num_return_sequences are its hypotheses; "
                                      "submit it alone, not as a group")
        if len(requests) > 1:
            group = Group(list(requests), requests[0].generator)
            for request in requests:
                request.group, request.generator = group, group.generator
        return requests

    def submit(self, request: Request) -> Request:
        """Queue `request` (with the rest of its group, which joins the batch together)."""
        for member in request.group.members if request.group is not None else [request]:
            if member.decoding is None:
                self.prepare(member)  # a beam request's makes its group
        batch = request.group.members if request.group is not None else [request]
        now = time.perf_counter()
        with self.wakeup:
            if request.adapter is not None and request.adapter not in self.adapters.names:  # unloaded meanwhile
                raise GenerationError(f"no adapter named {request.adapter!r} is loaded; load it first (add_adapter)")
            for member in batch:
                if not member.submitted:
                    member.submitted = now
                    self.waiting.append(member)
            self.wakeup.notify()
        return request

    def cancel(self, request: Request) -> None:
        """Stop `request` (and the other rows of its beam search); its slot is freed at the next step."""
        for row in request.group.members if request.group is not None and request.group.search else [request]:
            row.cancelled = True
        with self.wakeup:
            self.wakeup.notify()

    def add_adapter(self, name: str, weights: Weights) -> None:
        """Serve LoRA adapter `name` (module name -> (A, B, scaling)) beside the base model, per request."""
        with self._model_lock:
            with torch.inference_mode():  # the lean plans of the bare model serve the steps no adapter takes part in
                self._plan(1), self._plan(2)
            self.adapters.add(name, weights)
            self.model = self.adapters.model

    def remove_adapter(self, name: str) -> None:
        with self._model_lock, self.wakeup:
            if name not in self.adapters.names:
                raise GenerationError(f"no adapter named {name!r} is loaded")
            if any(r.adapter == name for r in [*self.running, *self.waiting]):
                raise GenerationError(f"adapter {name!r} still has requests running; unload it once they finish")
            self.adapters.remove(name)

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

    def serve_forever(self, after_step: Callable[[], None] | None = None) -> None:
        """Step while there is work, sleep while there is none, until `shutdown`; `after_step` is called after each
        step (an engine process sends the step's events from it)."""
        while True:
            with self.wakeup:
                while not self._stopped and not self.waiting and not self.running:
                    self.wakeup.wait()
                if self._stopped:
                    return
            self.step()
            if after_step is not None:
                after_step()

    def shutdown(self) -> None:
        with self.wakeup:
            self._stopped = True
            self.wakeup.notify()
        for request in list(self.running) + list(self.waiting):
            request.cancelled = True
            self._finish(request, "cancelled")
        self._emit_events()

    # ---- one step -------------------------------------------------------------------------------
    def step(self) -> None:
        with self._model_lock:
            self._step()

    @torch.inference_mode()
    def _step(self) -> None:
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
                    self._reuse(request)
        crosses = [self.seq2seq.cross] if self.seq2seq is not None else []  # kept by the same slots
        self.cache.compact(self.running, self.free, *crosses)
        # one token budget a step, as vLLM's chunked prefill: every running stream's next token first, prompt
        # chunks in what is left, so that arrivals lengthen a running stream's step by at most the budget
        decoding = sum(1 for r in self.running if r.output and not r.finished)
        budget, fresh, chunks = max(self.prefill_chunk - decoding, 0), set(), []
        for request in self.running:
            if budget == 0:
                break
            if request.prefilled < len(request.prompt) and not request.finished \
                    and (request.group is None or request.group.leader() is request):
                count = len(request.prompt) - request.prefilled
                chunks.append((request, count if self.seq2seq is not None else min(count, budget)))  # a source whole
                budget = max(budget - chunks[-1][1], 0)
                fresh.update(id(m) for m in (request.group.members if request.group is not None else [request]))
        if chunks:
            self._prefill(chunks)
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

    def _prefill(self, chunks: list[tuple[Request, int]]) -> None:
        """Feed each request its next `count` prompt tokens ((request, count) pairs): one that wants every position's
        log-probability alone, the others as one left-padded batch; after a prompt's last token, choose its first
        new token. An encoder-decoder's requests each take generate's first step alone (`EncoderDecoderRows`)."""
        if self.seq2seq is not None:
            for request, count in chunks:
                self._prefilled(request, self.seq2seq.admit(request, self.cache), 0, count)
            return
        batch = [c for c in chunks if c[0].prompt_logprobs is None]
        for rows in [[c] for c in chunks if c[0].prompt_logprobs is not None] + ([batch] if batch else []):
            requests, starts, counts = [r for r, _ in rows], [r.prefilled for r, _ in rows], [c for _, c in rows]
            self.adapters.route([r.adapter for r in requests])
            logits = prefill_logits(self.model, self.cache, [(r.slot, r.prompt[s:s + c], s) for r, s, c in
                                                             zip(requests, starts, counts)],
                                    keep_all=requests[0].prompt_logprobs is not None)
            self.adapters.rows = {}  # a forward outside the engine (generate on the model) is the base model's
            for row, (request, start, count) in enumerate(zip(requests, starts, counts)):
                self._prefilled(request, logits[row], start, start + count)

    def _prefilled(self, request: Request, logits: torch.Tensor, start: int, end: int) -> None:
        """Record that `request`'s prompt is in its slot up to `end`; `logits` of its chunk start..end-1 (all or the
        last); after the last prompt token, choose the first new token."""
        prompt = request.prompt
        if self.seq2seq is None:  # an encoder-decoder's slot holds its decoder prompt, written at admission
            self.cache.lengths[request.slot] = end
        request.prefilled = end
        if self.prefix is not None:
            self.prefix.store(self.cache, request.slot, prompt[:end], self.adapters.key(request.adapter))
        if request.prompt_logprobs is not None:
            record_prompt_logprobs(request, logits, start, end)
        if end == len(prompt):
            members = [request] if request.group is None else [m for m in request.group.members if not m.finished]
            for member in members:
                if member is not request:  # the rest of the group takes the prompt as this request prefilled it
                    self.cache.copy(request.slot, member.slot)
                    if self.seq2seq is not None:
                        self.seq2seq.cross.copy(request.slot, member.slot)
                    member.decoder_prompt = request.decoder_prompt
                    member.prefilled = end
                    member.prompt_token_logprobs = list(request.prompt_token_logprobs)
                    member.prompt_top_logprobs = list(request.prompt_top_logprobs)
            if request.score_only:
                for member in members:
                    self._finish(member, "length")
            elif request.group is None:
                self._choose(request, logits[-1:])
            else:  # every member continues the prompt's last logits: one row each
                request.group.step(self, logits[-1:].expand(len(members), -1).clone(),
                                   {id(m): j for j, m in enumerate(members)})

    def _reuse(self, request: Request) -> None:
        """Start a newly admitted request (a group's leader) from the longest prefix of its prompt the prefix cache
        holds; not one that asked for prompt log-probabilities, which need every prompt position's logits."""
        if self.prefix is None or request.prompt_logprobs is not None \
                or (request.group is not None and request is not request.group.members[0]):
            return
        request.cached_tokens = request.prefilled = self.prefix.load(self.cache, request.slot, request.prompt,
                                                                     self.adapters.key(request.adapter))

    def _decode(self, requests: list[Request]) -> None:
        slots = [r.slot for r in requests]
        tokens = torch.tensor([[r.output[-1]] for r in requests], device=self.device)
        adapted = self.adapters.route([r.adapter for r in requests])
        plan = None if adapted or self.seq2seq is not None else self._plan(len(requests))
        view = DecodeView(self.cache, slots, self.device, self.windows) if self.seq2seq is None else None
        if self.seq2seq is not None:
            logits = self.seq2seq.logits(self.cache, slots, tokens)
        elif plan is not None:
            logits = plan.step(tokens, view, view.lengths[:, None], view.allowed)
        else:
            logits = self.model(tokens, attention_mask=view.allowed, position_ids=view.lengths[:, None],
                                past_key_values=view, use_cache=True, logits_to_keep=1).logits[:, -1]
            self.adapters.rows = {}
        for slot in slots:
            self.cache.lengths[slot] += 1
        logits = logits.float()
        plain = [r.plain_greedy for r in requests]
        argmax = logits.argmax(-1).tolist() if any(plain) else None
        groups: dict[int, tuple[Group, dict[int, int]]] = {}
        for row, request in enumerate(requests):
            if request.group is None:
                self._choose(request, logits[row:row + 1], argmax[row] if plain[row] else None)
            else:
                groups.setdefault(id(request.group), (request.group, {}))[1][id(request)] = row
        for group, rows in groups.values():
            group.step(self, logits, rows)

    def _plan(self, rows: int):
        """The lean one-token step `generate` takes too, where the model has one (None: decode via modules)."""
        several = rows > 1
        if several not in self._plans:
            self._plans[several] = self.model.decode_plan(max(rows, 2) if several else 1)
        return self._plans[several]

    def _scores(self, request: Request, logits: torch.Tensor) -> torch.Tensor:
        """The processed scores (1, V) of `request`'s next token from its raw logits (1, V)."""
        decoding, prompt = request.decoding, request.history
        acts = decoding.processors.acts_at(len(prompt) + len(request.output))
        sequence = torch.tensor([prompt + request.output], device=self.device) if acts else None
        return next_scores(sequence, logits, decoding)

    def _choose(self, request: Request, logits: torch.Tensor | None, token: int | None = None) -> None:
        """Pick the next token of `request` from its raw logits (1, V) (or take `token`, a plain greedy row's argmax
        or a group's draw: logits then only for log-probabilities), record it and check its stop criteria."""
        decoding = request.decoding
        if token is None:
            token = int(pick(self._scores(request, logits), decoding.config.do_sample, request.generator)[0])
        raw = logits
        request.output.append(token)
        if request.logprobs is not None:
            log_probs = torch.log_softmax(raw[0], dim=-1)  # the model's own distribution
            request.token_logprobs.append(float(log_probs[token]))
            request.top_logprobs.append(top_logprobs(log_probs, request.logprobs, token))
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
        if request.slot is not None and self.prefix is not None and reason != "cancelled" \
                and (request.group is None or not request.group.search):  # a beam's output is not its slot's
            self.prefix.store(self.cache, request.slot, request.prompt + request.output, self.adapters.key(request.adapter))
        if request.slot is not None:
            self.free.append(request.slot)
            self.free.sort()  # low slots first keeps the batch's rows consecutive more often
        if request.on_event is not None:
            self._events.append(request)  # done is set after the call
        else:
            request.done.set()

