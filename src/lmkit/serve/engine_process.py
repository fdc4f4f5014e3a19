"""The engine in a process of its own, as vLLM's EngineCore: the model and the scheduler loop run in a child
process (`python -m lmkit.serve.engine_process`), apart from the HTTP process's event loop and interpreter lock.

The two talk over a pair of pipes in JSON lines: the server sends requests (prompt, settings, seed, grammar spec),
cancels and adapter loads; the core answers once per step with every request's new tokens, log-probabilities and
finish reason, which a reader thread writes into the server's own `Request` objects (so the HTTP side reads them as
it reads the in-thread engine's). The server keeps a local `Engine` that never steps over the model's skeleton
(`hub.load_skeleton`: config, shapes and generation defaults on the meta device, no weights): it checks a request's
settings and an adapter's shapes before they are sent, so a bad one is still a 400 at once, while only the child holds
the weights.

When the core dies (killed, out of memory, a crash in a kernel) the reader sees its pipe close: every request in
flight finishes with reason "error" (the routes answer 503, or an error event on a stream), new requests get 503
while a fresh core loads, and the server serves again once it is ready.
"""
from __future__ import annotations

import json
import os
import subprocess
import sys
import threading
import time

import torch

from lmkit.errors import GenerationError
from lmkit.generation.config import GenerationConfig
from lmkit.generation.engine import Engine, Request
from lmkit.generation.grammar import Grammar, GrammarConstraint
from lmkit.serve.protocol import APIError


def _unavailable(message: str) -> APIError:
    return APIError(503, message, code="engine_unavailable", headers={"Retry-After": "1"})


class ProcessEngine(Engine):
    """An `Engine` whose steps run in a child process (see the module docstring). `settings`: what the child loads,
    {"folder", "dtype" ("bf16" or None), "device", "threads" (torch's intra-op threads)}; `loras`: {name: adapter folder} it loads at each start."""

    remote = True

    def __init__(self, model, settings: dict, max_batch: int = 16, prefill_chunk: int = 2048, cache_memory: int = 0,
                 loras: dict[str, str] | None = None):
        super().__init__(model, max_batch=max_batch, prefill_chunk=prefill_chunk, cache_memory=cache_memory)
        self.device = torch.device("cpu")  # of the checks' tensors only (the model may be a meta skeleton)
        self.settings = {**settings, "max_batch": max_batch, "prefill_chunk": prefill_chunk,
                         "cache_memory": cache_memory}
        self.lora_folders = dict(loras or {})
        self.live: dict[int, Request] = {}  # id -> request sent to the core and not finished
        self.lock = threading.Lock()  # live, alive and the pipe's writes
        self.alive = False
        self.restarts = 0
        self.process: subprocess.Popen | None = None
        self._ids = 0
        self._replies: dict[str, tuple[threading.Event, list]] = {}
        self._closed = threading.Event()
        self._start()

    # ---- the core's life ------------------------------------------------------------------------
    @property
    def pid(self) -> int | None:
        return self.process.pid if self.process is not None else None

    def _start(self) -> None:
        """Start a core and wait until it has loaded; a core that cannot load raises GenerationError."""
        to_core, core_in = os.pipe()
        core_out, from_core = os.pipe()
        settings = {**self.settings, "loras": self.lora_folders}
        process = subprocess.Popen([sys.executable, "-m", "lmkit.serve.engine_process", str(to_core), str(from_core),
                                    json.dumps(settings)], pass_fds=(to_core, from_core), stdin=subprocess.DEVNULL)
        os.close(to_core), os.close(from_core)
        writer, reader = os.fdopen(core_in, "w", buffering=1), os.fdopen(core_out, "r")
        first = reader.readline()
        message = json.loads(first) if first else {"op": "failed", "error": f"it exited ({process.wait()})"}
        if message.get("op") != "ready":
            writer.close(), reader.close()
            raise GenerationError(f"the engine process could not start: {message.get('error')}")
        with self.lock:
            self.process, self.writer, self.alive = process, writer, True
        threading.Thread(target=self._read, args=(reader, process), name="lmkit-engine-reader", daemon=True).start()

    def _read(self, reader, process) -> None:
        for line in reader:
            message = json.loads(line)
            if message["op"] == "events":
                self._apply(message["items"])
                if self.prefix is not None and "prefix" in message:  # the core's counts, for /metrics
                    self.prefix.queried, self.prefix.hits = message["prefix"]
            elif message["op"] == "reply":
                event, box = self._replies.pop(message["key"], (None, None))
                if event is not None:
                    box.append(message.get("error"))
                    event.set()
        reader.close()
        process.wait()
        self._died()

    def _died(self) -> None:
        """The core is gone: fail what it held, then start another (unless the server is shutting down)."""
        with self.lock:
            self.alive = False
            lost, self.live = list(self.live.values()), {}
            try:
                self.writer.close()
            except OSError:
                pass
        for event, box in list(self._replies.values()):
            box.append("the engine process stopped")
            event.set()
        for request in lost:
            request.finish_reason = "error"
            self._notify(request)
        while not self._closed.is_set():
            try:
                self._start()
                self.restarts += 1
                return
            except GenerationError as exc:
                print(f"lmkit serve: {exc}; trying again", file=sys.stderr, flush=True)
                time.sleep(1)

    def _send(self, message: dict) -> None:
        """Write one line to the core (the caller holds `lock`); a dead pipe is a 503."""
        if not self.alive:
            raise _unavailable("the engine process is restarting; retry shortly")
        try:
            self.writer.write(json.dumps(message) + "\n")
        except (OSError, ValueError):  # the core died between the check and the write
            raise _unavailable("the engine process stopped; retry shortly") from None

    def _call(self, message: dict, timeout: float = 600.0) -> None:
        """Send `message` and wait for the core's reply; its error as a GenerationError."""
        key = f"{time.monotonic_ns()}-{id(message)}"
        event, box = threading.Event(), []
        self._replies[key] = (event, box)
        with self.lock:
            self._send({**message, "key": key})
        if not event.wait(timeout) or box[0]:
            raise GenerationError(f"the engine process could not {message['op']}: {box[0] if box else 'no answer'}")

    # ---- the Engine interface -------------------------------------------------------------------
    def submit(self, request: Request) -> Request:
        batch = request.group.members if request.group is not None else [request]
        for member in batch:
            if member.decoding is None:
                self.prepare(member)
        if any(m.submitted for m in batch):
            return request
        now = time.perf_counter()
        items = []
        with self.lock:
            for member in batch:
                self._ids += 1
                member.core_id, member.submitted = self._ids, now
                items.append(_encode(member))
            self._send({"op": "submit", "requests": items})
            for member in batch:
                self.live[member.core_id] = member
        return request

    def cancel(self, request: Request) -> None:
        request.cancelled = True
        with self.lock:
            if getattr(request, "core_id", None) in self.live and self.alive:
                try:
                    self._send({"op": "cancel", "id": request.core_id})
                except APIError:
                    pass

    def counts(self) -> tuple[int, int]:
        held = len(self.live)
        return min(held, self.max_batch), max(held - self.max_batch, 0)

    def add_adapter(self, name: str, weights, folder: str | None = None) -> None:
        """Serve adapter `name` here (for checking requests) and in the core, which reads it from `folder`."""
        if folder is None:
            raise GenerationError("the engine process loads an adapter from its folder; give folder")
        self._call({"op": "add_adapter", "name": name, "folder": str(folder)})
        with self._model_lock:  # its names and shapes only: this engine never steps
            self.adapters.add(name, weights)
        self.lora_folders[name] = str(folder)

    def remove_adapter(self, name: str) -> None:
        if any(r.adapter == name for r in list(self.live.values())):
            raise GenerationError(f"adapter {name!r} still has requests running; unload it once they finish")
        self._call({"op": "remove_adapter", "name": name})
        super().remove_adapter(name)
        self.lora_folders.pop(name, None)

    def run_all(self, requests: list[Request]) -> list[Request]:
        for request in requests:
            self.submit(request)
        for request in requests:
            request.done.wait()
        return requests

    def serve_forever(self, after_step=None) -> None:
        self._closed.wait()  # the core steps on its own; this only keeps Engine's contract

    def shutdown(self) -> None:
        self._closed.set()
        with self.lock:
            try:
                self.writer.close()  # the core exits when its command pipe closes
            except OSError:
                pass
        if self.process is not None:
            try:
                self.process.wait(timeout=10)
            except subprocess.TimeoutExpired:
                self.process.kill()

    # ---- events ---------------------------------------------------------------------------------
    def _apply(self, items: list[dict]) -> None:
        for item in items:
            with self.lock:
                request = self.live.get(item["id"])
                if request is not None and item["finish"] is not None:
                    del self.live[item["id"]]
            if request is None:
                continue
            request.prompt_token_logprobs += item["plp"]
            request.prompt_top_logprobs += [_top(t) for t in item["ptop"]]
            request.token_logprobs += item["lp"]
            request.top_logprobs += [_top(t) for t in item["top"]]
            request.cached_tokens = item["cached"]
            request.output += item["tokens"]  # last: a reader seeing the tokens sees their log-probabilities
            request.finish_reason = item["finish"]
            self._notify(request)

    @staticmethod
    def _notify(request: Request) -> None:
        if request.on_event is not None:
            request.on_event(request)
        if request.finished:
            request.done.set()


def _top(pairs):
    return None if pairs is None else {int(k): v for k, v in pairs}


def _encode(request: Request) -> dict:
    """A request as the core rebuilds it: its fields, and each grammar as the spec it was compiled from."""
    grammars = []
    for processor in request.processors:
        if not isinstance(processor, GrammarConstraint) or processor.grammar is None:
            raise GenerationError("the engine process takes grammar constraints (with their Grammar) as a request's "
                                  "own processors, nothing else")
        grammars.append({"kind": processor.grammar.kind, "value": processor.grammar.value,
                         "any_whitespace": processor.grammar.any_whitespace, "eos": processor.eos})
    return {"id": request.core_id, "prompt": request.prompt, "config": request.config.to_dict(), "seed": request.seed,
            "logprobs": request.logprobs, "prompt_logprobs": request.prompt_logprobs,
            "score_only": request.score_only, "presence_penalty": request.presence_penalty,
            "frequency_penalty": request.frequency_penalty, "stop_skip": request.stop_skip,
            "adapter": request.adapter, "grammars": grammars}


# ---- the child: the core ---------------------------------------------------------------------------
class Core:
    """The engine's loop in the child: commands from one pipe, one line of events per step to the other."""

    def __init__(self, engine: Engine, tokenizer, out):
        self.engine, self.tokenizer, self.out = engine, tokenizer, out
        self.requests: dict[int, Request] = {}
        self.sent: dict[int, tuple[int, int]] = {}  # id -> (output tokens, prompt log-probabilities) already sent
        self.due: list[Request] = []
        self.write_lock = threading.Lock()

    def write(self, message: dict) -> None:
        with self.write_lock:
            self.out.write(json.dumps(message) + "\n")

    def command(self, message: dict) -> None:
        op = message["op"]
        if op == "submit":
            try:
                members = [self._request(item) for item in message["requests"]]
                self.engine.prepare_group(members)
                self.engine.submit(members[0])
            except Exception as exc:  # checked by the server already; a request the core still refuses fails alone
                print(f"lmkit engine: a request failed: {exc}", file=sys.stderr, flush=True)
                self.write({"op": "events", "items": [
                    {"id": item["id"], "tokens": [], "lp": [], "top": [], "plp": [], "ptop": [], "cached": 0,
                     "finish": "error"} for item in message["requests"]]})
                for item in message["requests"]:
                    self.requests.pop(item["id"], None), self.sent.pop(item["id"], None)
        elif op == "cancel":
            request = self.requests.get(message["id"])
            if request is not None:
                self.engine.cancel(request)
        elif op in ("add_adapter", "remove_adapter"):
            from lmkit.peft import lora_weights

            error = None
            try:
                if op == "add_adapter":
                    self.engine.add_adapter(message["name"], lora_weights(self.engine.adapters.bare, message["folder"]))
                else:
                    self.engine.remove_adapter(message["name"])
            except Exception as exc:  # the server reports it to the client that asked
                error = str(exc) or type(exc).__name__
            self.write({"op": "reply", "key": message["key"], "error": error})

    def moved(self, request: Request) -> None:
        self.due.append(request)

    def _request(self, item: dict) -> Request:
        vocab = self.engine.model.config.vocab_size
        processors = [GrammarConstraint.build(self.tokenizer, vocab, Grammar(g["kind"], g["value"], g["any_whitespace"]),
                                              1, len(item["prompt"]), g["eos"]) for g in item["grammars"]]
        request = Request(prompt=item["prompt"], config=GenerationConfig.from_dict(item["config"]), seed=item["seed"],
                          tokenizer=self.tokenizer, logprobs=item["logprobs"], prompt_logprobs=item["prompt_logprobs"],
                          score_only=item["score_only"], presence_penalty=item["presence_penalty"],
                          frequency_penalty=item["frequency_penalty"], stop_skip=item["stop_skip"],
                          processors=processors, adapter=item["adapter"], on_event=self.moved)
        self.requests[item["id"]] = request
        request.core_id = item["id"]
        self.sent[item["id"]] = (0, 0)
        return request

    def flush(self) -> None:
        """One line with what each request that moved this step has new."""
        due, self.due = self.due, []
        items = []
        for request in {id(r): r for r in due}.values():
            tokens, prompt = self.sent[request.core_id]
            items.append({"id": request.core_id, "tokens": request.output[tokens:],
                          "lp": request.token_logprobs[tokens:],
                          "top": [None if t is None else list(t.items()) for t in request.top_logprobs[tokens:]],
                          "plp": request.prompt_token_logprobs[prompt:],
                          "ptop": [None if t is None else list(t.items()) for t in request.prompt_top_logprobs[prompt:]],
                          "cached": request.cached_tokens, "finish": request.finish_reason})
            self.sent[request.core_id] = (len(request.output), len(request.prompt_token_logprobs))
            if request.finished:
                del self.requests[request.core_id], self.sent[request.core_id]
        if items:
            prefix = self.engine.prefix
            self.write({"op": "events", "items": items,
                        **({"prefix": [prefix.queried, prefix.hits]} if prefix is not None else {})})

    def listen(self, source) -> None:
        """Read commands until the server closes the pipe (or dies), then stop the loop."""
        for line in source:
            self.command(json.loads(line))
        self.engine.shutdown()

def main(argv: list[str]) -> int:
    commands, events, settings = int(argv[0]), int(argv[1]), json.loads(argv[2])
    out = os.fdopen(events, "w", buffering=1)
    try:
        import torch

        import lmkit
        from lmkit.peft import lora_weights

        if settings.get("threads"):
            torch.set_num_threads(settings["threads"])
        dtype = torch.bfloat16 if settings["dtype"] == "bf16" else None
        model = lmkit.load_model(settings["folder"], dtype=dtype, device=settings["device"])
        tokenizer = lmkit.load_tokenizer(settings["folder"])
        engine = Engine(model, max_batch=settings["max_batch"], prefill_chunk=settings["prefill_chunk"],
                        cache_memory=settings["cache_memory"])
        for name, folder in settings["loras"].items():
            engine.add_adapter(name, lora_weights(engine.adapters.bare, folder))
    except Exception as exc:  # the server says it in one line and exits 2 (at start-up) or keeps trying
        out.write(json.dumps({"op": "failed", "error": str(exc) or type(exc).__name__}) + "\n")
        return 1
    core = Core(engine, tokenizer, out)
    try:
        core.write({"op": "ready"})
        threading.Thread(target=core.listen, args=(os.fdopen(commands, "r"),), daemon=True).start()
        engine.serve_forever(after_step=core.flush)
    except BrokenPipeError:  # the server is gone: nobody is left to answer
        return 0
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
