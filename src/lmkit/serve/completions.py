"""/v1/completions and /v1/chat/completions over the engine: requests built from checked fields, tokens carried
from the engine's thread to the event loop, answers as one JSON body or as server-sent events."""
from __future__ import annotations

import asyncio
import json
import threading
import time
import uuid
from dataclasses import dataclass, field

from lmkit.generation.engine import Request
from lmkit.generation.grammar import GrammarConstraint
from lmkit.serve.protocol import APIError, Sampling
from lmkit.serve.text import StopText


@dataclass
class Choice:
    """One sequence of an answer: the engine request and what the client has been shown of it."""

    index: int
    request: Request
    text: StopText
    wake: asyncio.Event = field(default_factory=asyncio.Event)
    shown: int = 0  # output tokens already turned into text
    last: float = 0.0  # when the previous token arrived
    holding: bool = False  # with tools: the reply may be a tool call, so its text waits for the end
    streamed: str = ""  # the content already sent
    produced: str = ""  # the content the stop-string filter has let through, sent or held


class Waker:
    """Sets asyncio events of one loop from the engine's thread. The events set while the loop has not run yet share
    one `call_soon_threadsafe` (a write to the loop's wake-up socket and a hand-over of the interpreter lock), so a
    step that advances many streams wakes the loop once, not once per stream."""

    def __init__(self, loop: asyncio.AbstractEventLoop):
        self.loop, self.lock = loop, threading.Lock()
        self.pending: list[asyncio.Event] = []

    def wake(self, event: asyncio.Event) -> None:
        with self.lock:
            self.pending.append(event)
            if len(self.pending) > 1:
                return  # a flush is already scheduled
        try:
            self.loop.call_soon_threadsafe(self._flush)
        except RuntimeError:  # a loop already closed has no one to wake
            pass

    def _flush(self) -> None:
        with self.lock:
            events, self.pending = self.pending, []
        for event in events:
            event.set()


def waker_for(server, loop: asyncio.AbstractEventLoop) -> Waker:
    """The server's waker for `loop` (one per server: it serves from one loop)."""
    waker = getattr(server, "waker", None)
    if waker is None or waker.loop is not loop:
        waker = server.waker = Waker(loop)
    return waker


class Generation:
    """The choices of one HTTP request, submitted to the server's engine."""

    def __init__(self, server, prompts: list[list[int]], sampling: Sampling, max_new_tokens: list[int],
                 logprobs: int | None, echo: bool, chat: bool, grammar=None, tools=None, adapter: str | None = None):
        """`grammar`: a `structured.Compiled` grammar every choice is constrained to (None: free); `tools`: a `tools.ToolMode`
        whose calls the replies are parsed for; `adapter`: the LoRA adapter the choices decode with (None: the base
        model), the answer's model."""
        self.tools = tools
        self.server, self.sampling, self.logprobs, self.echo, self.chat = server, sampling, logprobs, echo, chat
        self.model = adapter or server.model_name
        self.prompts = prompts
        self.id = ("chatcmpl-" if chat else "cmpl-") + uuid.uuid4().hex
        self.created = int(time.time())
        waker = waker_for(server, asyncio.get_running_loop())
        self.choices: list[Choice] = []
        groups = []
        for p, prompt in enumerate(prompts):  # a prompt's n choices: the rows of generate(num_return_sequences=n)
            groups.append([])
            for _ in range(sampling.n):
                score_only = max_new_tokens[p] == 0
                seed = None if sampling.seed is None else sampling.seed % 2 ** 63
                request = Request(prompt=prompt, config=sampling.generation_config(max(max_new_tokens[p], 1),
                                                                                  server.end_ids),
                                  seed=seed, tokenizer=server.tokenizer, logprobs=logprobs,
                                  prompt_logprobs=logprobs if echo and logprobs is not None else None,
                                  score_only=score_only, presence_penalty=sampling.presence_penalty,
                                  frequency_penalty=sampling.frequency_penalty, adapter=adapter,
                                  stop_skip=max(sampling.min_tokens - 1, 0),
                                  processors=[] if grammar is None else [
                                      GrammarConstraint(grammar.compiled, 1, len(prompt), server.end_ids,
                                                        grammar=grammar.grammar)])
                choice = Choice(len(self.choices), request, StopText(server.tokenizer, sampling.stop, server.special_ids,
                                                                 sampling.min_tokens))
                request.on_event = lambda _r, c=choice: waker.wake(c.wake)
                self.choices.append(choice)
                groups[-1].append(request)
        for group in groups:
            server.engine.prepare_group(group)

    def submit(self) -> None:
        now = time.perf_counter()
        for choice in self.choices:
            choice.last = now
            self.server.engine.submit(choice.request)
        self.server.metrics.prompt_tokens.inc(sum(len(p) for p in self.prompts))

    def cancel(self) -> None:
        for choice in self.choices:
            if not choice.request.finished:
                self.server.engine.cancel(choice.request)

    def _advance(self, choice: Choice) -> tuple[str, list[int], str | None]:
        """(new text, new token ids, finish reason) since the last call."""
        request = choice.request
        finished = request.finish_reason
        output = list(request.output)
        new = output[choice.shown:]
        now = time.perf_counter()
        metrics = self.server.metrics
        for k in range(len(new)):
            if choice.shown + k == 0:
                metrics.time_to_first_token.observe(now - request.submitted)
            else:
                metrics.inter_token_latency.observe((now - choice.last) / len(new))
        if new:
            choice.last = now
            metrics.generation_tokens.inc(len(new))
        choice.shown = len(output)
        delta = choice.text.push(output, final=finished is not None)
        if choice.text.stopped and finished is None:  # a stop the engine has not seen yet (special tokens)
            self.server.engine.cancel(request)
            finished = "stop"
        if finished == "cancelled":
            finished = "stop"
        return delta, new, finished

    async def wait(self, choice: Choice) -> None:
        await choice.wake.wait()
        choice.wake.clear()

    # ---- whole answers ------------------------------------------------------------------------------
    async def complete(self, is_disconnected) -> dict:
        pending = set(range(len(self.choices)))
        while pending:
            for i in list(pending):
                if self.choices[i].request.finished:
                    pending.discard(i)
            if not pending:
                break
            waits = [asyncio.ensure_future(self.wait(self.choices[i])) for i in pending]
            await asyncio.wait(waits, timeout=0.5, return_when=asyncio.FIRST_COMPLETED)
            for w in waits:
                w.cancel()
            if await is_disconnected():
                self.cancel()
                raise asyncio.CancelledError
        if any(c.request.finish_reason == "error" for c in self.choices):
            raise engine_failed()
        choices = []
        for choice in self.choices:
            text, _, finish = self._advance(choice)
            calls = self._calls(choice)
            if calls is not None:
                choices.append({"index": choice.index, "message": {"role": "assistant", "content": calls[0],
                                                                   "tool_calls": calls[1]},
                                "logprobs": self._chat_logprobs(choice.request, 0) if self.logprobs is not None
                                else None, "finish_reason": "tool_calls"})
                continue
            choices.append(self._final_choice(choice, choice.text.text, finish))
        return {"id": self.id, "object": "chat.completion" if self.chat else "text_completion",
                "created": self.created, "model": self.model, "choices": choices, "usage": self.usage()}

    def _raw(self, choice: Choice) -> str:
        """The reply's text with special tokens kept (a Mistral [TOOL_CALLS]), end tokens left out."""
        ends = set(self.server.end_ids)
        return self.server.tokenizer.decode([t for t in choice.request.output if t not in ends])

    def _calls(self, choice: Choice) -> tuple[str | None, list[dict]] | None:
        """(content, tool_calls) of a finished reply that calls tools, else None."""
        return None if self.tools is None else self.tools.calls(self._raw(choice))

    def _tool_chunks(self, choice: Choice, finish: str | None):
        """The end of a held reply: its tool calls as OpenAI streams them (a call's id and name, then its arguments
        in pieces), or the held text as content when it holds no call."""
        from lmkit.serve.tools import fragments

        calls = self._calls(choice)
        if calls is None:
            rest = choice.produced[len(choice.streamed):]
            yield self._chunk([{"index": choice.index, "delta": {"content": rest} if rest else {}, "logprobs": None,
                                "finish_reason": finish}])
            return
        content, tool_calls = calls
        if content and len(content) > len(choice.streamed):
            yield self._chunk([{"index": choice.index, "delta": {"content": content[len(choice.streamed):]},
                                "logprobs": None, "finish_reason": None}])
        for i, call in enumerate(tool_calls):
            head = {"index": i, "id": call["id"], "type": "function",
                    "function": {"name": call["function"]["name"], "arguments": ""}}
            yield self._chunk([{"index": choice.index, "delta": {"tool_calls": [head]}, "logprobs": None,
                                "finish_reason": None}])
            for piece in fragments(call["function"]["arguments"]):
                yield self._chunk([{"index": choice.index, "delta": {"tool_calls": [
                    {"index": i, "function": {"arguments": piece}}]}, "logprobs": None, "finish_reason": None}])
        yield self._chunk([{"index": choice.index, "delta": {}, "logprobs": None, "finish_reason": "tool_calls"}])

    def usage(self) -> dict:
        prompt = sum(len(p) for p in self.prompts)
        completion = sum(len(c.request.output) for c in self.choices)
        usage = {"prompt_tokens": prompt, "completion_tokens": completion, "total_tokens": prompt + completion}
        if self.server.engine.prefix is not None:  # OpenAI's count of prompt tokens the prefix cache served
            usage["prompt_tokens_details"] = {"cached_tokens": sum(c.request.cached_tokens for c in self.choices)}
        return usage

    def _final_choice(self, choice: Choice, text: str, finish: str | None) -> dict:
        request = choice.request
        if self.chat:
            return {"index": choice.index, "message": {"role": "assistant", "content": text},
                    "logprobs": self._chat_logprobs(request, 0) if self.logprobs is not None else None,
                    "finish_reason": finish}
        prefix = ""
        if self.echo:
            prefix = self.server.tokenizer.decode(request.prompt)
        return {"index": choice.index, "text": prefix + text, "finish_reason": finish,
                "logprobs": self._completion_logprobs(request, 0, self.echo) if self.logprobs is not None else None}

    # ---- log-probabilities in the two formats -------------------------------------------------------
    def _token(self, token: int) -> str:
        return self.server.tokenizer.decode([token])

    def _completion_logprobs(self, request: Request, start: int, echo: bool, offset: int = 0) -> dict:
        ids, values, tops = [], [], []
        if echo:
            ids += request.prompt
            values += request.prompt_token_logprobs
            tops += request.prompt_top_logprobs
        ids += request.output[start:]
        values += request.token_logprobs[start:]
        tops += request.top_logprobs[start:]
        tokens = [self._token(t) for t in ids]
        offsets = []
        for token in tokens:
            offsets.append(offset)
            offset += len(token)
        top = [None if t is None else self._by_text(t) for t in tops]
        return {"tokens": tokens, "token_logprobs": values, "top_logprobs": top, "text_offset": offsets}

    def _by_text(self, top: dict[int, float]) -> dict[str, float]:
        """Alternatives keyed by their text, likeliest first; ids that decode alike (pieces of one character)
        keep the likeliest one's value."""
        out: dict[str, float] = {}
        for token, value in sorted(top.items(), key=lambda kv: -kv[1]):
            out.setdefault(self._token(token), value)
        return out

    def _chat_logprobs(self, request: Request, start: int) -> dict:
        content = []
        for token, value, top in zip(request.output[start:], request.token_logprobs[start:],
                                     request.top_logprobs[start:]):
            text = self._token(token)
            alternatives = sorted(top.items(), key=lambda kv: -kv[1])[:self.logprobs]
            content.append({"token": text, "logprob": value, "bytes": list(text.encode()),
                            "top_logprobs": [{"token": self._token(k), "logprob": v, "bytes": list(self._token(k).encode())}
                                             for k, v in alternatives]})
        return {"content": content}

    # ---- streams ------------------------------------------------------------------------------------
    def _chunk(self, choices: list[dict], usage: dict | None = None) -> str:
        body = {"id": self.id, "object": "chat.completion.chunk" if self.chat else "text_completion",
                "created": self.created, "model": self.model, "choices": choices}
        if usage is not None:
            body["usage"] = usage
        return f"data: {json.dumps(body, ensure_ascii=False)}\n\n"

    async def stream(self):
        """Server-sent events: (chat: a role chunk first) text chunks, each choice's finish reason, the usage chunk
        when asked, then [DONE]. Closing the stream early (the client left) cancels the unfinished choices."""
        try:
            if self.chat:
                yield self._chunk([{"index": c.index, "delta": {"role": "assistant", "content": ""},
                                    "logprobs": None, "finish_reason": None} for c in self.choices])
            if self.echo:
                for c in self.choices:
                    yield self._chunk([{"index": c.index, "text": self.server.tokenizer.decode(c.request.prompt),
                                        "logprobs": None, "finish_reason": None}])
            open_choices = list(self.choices)
            while open_choices:
                if len(open_choices) == 1:
                    await self.wait(open_choices[0])
                else:
                    waits = [asyncio.ensure_future(self.wait(c)) for c in open_choices]
                    _, rest = await asyncio.wait(waits, return_when=asyncio.FIRST_COMPLETED)
                    for w in rest:
                        w.cancel()
                for choice in list(open_choices):
                    if choice.request.finish_reason == "error":  # the headers are sent: the 503 goes as an event
                        error = engine_failed().body()
                        error["error"]["code"] = 503  # in a stream, as vLLM sends it: the status as the code
                        yield f"data: {json.dumps(error)}\n\n"
                        yield "data: [DONE]\n\n"
                        return
                    if choice.request.finished or choice.shown < len(choice.request.output):
                        first = choice.shown
                        delta, new, finish = self._advance(choice)
                        choice.produced += delta
                        if self.tools is not None and self.tools.may_start(self._raw(choice)):
                            choice.holding = True  # a tool call may be coming: its text waits until it cannot be
                            if finish is not None:
                                for chunk in self._tool_chunks(choice, finish):
                                    yield chunk
                                open_choices.remove(choice)
                            continue
                        if choice.holding:  # what was held turned out to be text: it goes now
                            choice.holding, delta = False, choice.produced[len(choice.streamed):]
                        choice.streamed += delta
                        if delta or finish or (new and self.logprobs is not None):
                            yield self._chunk([self._stream_choice(choice, delta, first, finish)])
                        if finish is not None:
                            open_choices.remove(choice)
            if self.sampling.include_usage:
                yield self._chunk([], self.usage())
            yield "data: [DONE]\n\n"
        finally:
            self.cancel()

    def _stream_choice(self, choice: Choice, delta: str, first: int, finish: str | None) -> dict:
        request = choice.request
        if self.chat:
            logprobs = self._chat_logprobs(request, first) if self.logprobs is not None else None
            return {"index": choice.index, "delta": {"content": delta} if delta else {}, "logprobs": logprobs,
                    "finish_reason": finish}
        logprobs = self._completion_logprobs(request, first, False) if self.logprobs is not None else None
        return {"index": choice.index, "text": delta, "logprobs": logprobs, "finish_reason": finish}


def engine_failed() -> APIError:
    """The answer to requests in flight when the engine process died (a fresh one is starting)."""
    return APIError(503, "the engine process stopped while answering this request; it is restarting, retry shortly",
                    code="engine_failed", headers={"Retry-After": "1"})


def check_context(prompt: list[int], max_new_tokens: int, context: int) -> None:
    if len(prompt) + max_new_tokens > context:
        raise APIError(400, f"this model's context is {context} tokens, but the prompt has {len(prompt)} and "
                            f"max_tokens asks for {max_new_tokens} more; shorten the prompt or lower max_tokens",
                       param="max_tokens" if len(prompt) < context else "prompt", code="context_length_exceeded")
