"""The OpenAI-compatible HTTP server: `build_app(folder, ...)` returns a FastAPI app.

The model loads in a thread after start-up unless it was loaded before (`lmkit serve` loads it first, so that a
folder that cannot load is refused before the port opens; /health answers 503 until it is ready); a decoder folder
decodes through one continuous-batching `Engine` in its own thread and stops at every end token the folder declares
(`chat_session.end_ids`); a request that leaves a sampling field unset takes the folder's generation_config.json value,
as vLLM's `--generation-config auto` does. An encoder or sentence-transformers folder answers /v1/embeddings with
SentenceEncoder's numbers. Every error is OpenAI's error body; bad input is a 4xx.
"""
from __future__ import annotations

import base64
import json
import threading
from pathlib import Path

from fastapi import FastAPI, Request
from fastapi.responses import FileResponse, Response, StreamingResponse
from starlette.concurrency import run_in_threadpool

import lmkit
from lmkit.errors import LmkitError
from lmkit.chat_session import end_ids, sampling_defaults
from lmkit.generation.engine import Engine
from lmkit.generation.prefix_cache import token_bytes
from lmkit.serve.completions import Generation, check_context
from lmkit.serve.http import AccessLog, BearerGuard, error_response, read_json
from lmkit.serve.lora import load_lora, model_cards, register as register_lora
from lmkit.serve.metrics import Metrics
from lmkit.serve.structured import STRUCTURED_FIELDS, compile_grammar, compile_structured, warm_grammars
from lmkit.serve.prompts import chat_prompt, ground, with_sources
from lmkit.serve.tools import parse_tools
from lmkit.serve.protocol import (CHAT_FIELDS, COMPLETION_FIELDS, APIError, flag, check_fields, parse_infill,
                                  parse_logprobs, parse_messages, parse_prompts, parse_sampling)

STATIC = Path(__file__).parent / "static"


class Server:
    """What the routes share: the loaded model, tokenizer, engine and metrics."""

    def __init__(self, folder: str | Path, max_concurrency: int = 16, max_queue: int = 256, prefill_chunk: int = 2048,
                 model_name: str | None = None, rag: str | Path | None = None, device=None, cache_memory: int | None = 0,
                 loras: dict[str, str] | None = None, dtype=None, encoder_dtype=None, engine_process: bool = False):
        """`cache_memory`: bytes of the prefix cache (0: none, None: the default size); `loras`: {name: adapter folder}
        served per request; `dtype`, `encoder_dtype`: the torch dtype of a decoder's and of an embedding folder's
        weights (None: float32); `engine_process`: a decoder's engine steps in a child process
        (`engine_process.ProcessEngine`), restarted when it dies."""
        self.engine_process = engine_process
        self.folder, self.rag_path, self.rag = Path(folder), rag, None
        self.cache_memory, self.lora_folders, self.loras = cache_memory, dict(loras or {}), {}
        self.device = device  # where the model (and the RAG index's encoder) run; None: the CPU
        self.dtype, self.encoder_dtype = dtype, encoder_dtype  # a decoder's and an encoder's torch dtype (None: fp32)
        self.model_name = model_name or self.folder.name
        self.max_concurrency, self.max_queue, self.prefill_chunk = max_concurrency, max_queue, prefill_chunk
        self.ready = threading.Event()
        self.load_error: str | None = None
        self.engine = self.encoder = self.model = self.tokenizer = None
        self.waker = None  # completions.Waker: wakes the loop's streams from the engine thread
        self.special_ids: set[int] = set()
        self.end_ids: list[int] = []  # every token a reply stops at
        self.sampling_defaults: dict = {}  # generation_config.json's values for unset request fields
        self.loading = threading.Lock()  # held by the one load (start-up's or the lifespan's)
        self.metrics = Metrics(lambda: self.engine.counts() if self.engine is not None else (0, 0),
                               lambda: self.engine.prefix if self.engine is not None else None)

    def load(self) -> None:
        """Load the folder once (a second call returns at once); a failure is kept in `load_error`."""
        if not self.loading.acquire(blocking=False):
            return
        try:
            if self.rag_path is not None:
                from lmkit.rag.store import RagIndex

                self.rag = RagIndex.open(self.rag_path, device=self.device)
            encoder_folder = (self.folder / "modules.json").is_file()
            model = None if encoder_folder else _load(self.folder, self.dtype, self.device, self.engine_process)
            if model is None or model.config.architecture not in ("decoder", "encoder-decoder"):  # the engine's
                self.encoder = lmkit.SentenceEncoder.from_pretrained(self.folder, dtype=self.encoder_dtype,
                                                                     device=self.device)
                self.tokenizer = self.encoder.tokenizer
            else:
                self.model = model
                self.tokenizer = lmkit.load_tokenizer(self.folder)
                self.special_ids = set(getattr(self.tokenizer, "all_special_ids", []) or [])
                self.end_ids, self.sampling_defaults = end_ids(model, self.tokenizer), sampling_defaults(model)
                memory = self.cache_memory  # None: 1 GiB, or one full context where that is more
                if memory is None:
                    memory = max(1 << 30, token_bytes(model) * model.config.max_seq_len)
                if self.engine_process:
                    from lmkit.serve.engine_process import ProcessEngine

                    import torch

                    # the child computes with the server's own torch thread count (torch.set_num_threads before
                    # build_app, or OMP_NUM_THREADS), not the default of all cores
                    settings = {"folder": str(self.folder), "dtype": "bf16" if self.dtype is not None else None,
                                "device": None if self.device is None else str(self.device),
                                "threads": torch.get_num_threads()}
                    self.engine = ProcessEngine(self.model, settings, max_batch=self.max_concurrency,
                                                prefill_chunk=self.prefill_chunk, cache_memory=memory)
                else:
                    self.engine = Engine(self.model, max_batch=self.max_concurrency, prefill_chunk=self.prefill_chunk,
                                         cache_memory=memory)
                for name, lora_folder in self.lora_folders.items():
                    load_lora(self, name, lora_folder)
                threading.Thread(target=self.engine.serve_forever, name="lmkit-engine", daemon=True).start()
                threading.Thread(target=warm_grammars, args=(self,), name="lmkit-grammar", daemon=True).start()
        except (LmkitError, OSError) as exc:
            self.load_error = str(exc)
        self.ready.set()

    def check_ready(self) -> None:
        if not self.ready.is_set():
            raise APIError(503, "the model is still loading; retry shortly", code="loading",
                           headers={"Retry-After": "1"})
        if self.load_error:
            raise APIError(503, f"the model failed to load: {self.load_error}", code="load_failed")
        if self.engine is not None and not getattr(self.engine, "alive", True):
            raise APIError(503, "the engine process is restarting; retry shortly", code="engine_unavailable",
                           headers={"Retry-After": "1"})

    def check_model(self, body: dict) -> str | None:
        """The LoRA adapter the request's model names (None: the base model); a request naming another model gets
        OpenAI's 404 (model_not_found), as vLLM answers it."""
        name = body.get("model")
        if name is not None and not isinstance(name, str):
            raise APIError(400, "model: must be a string", param="model", code="invalid_value")
        if name is not None and name != self.model_name and name not in self.loras:
            raise APIError(404, f"The model `{name}` does not exist; this server serves `{self.model_name}` "
                                "(GET /v1/models lists it)", param="model", code="model_not_found",
                           kind="invalid_request_error")
        return name if name in self.loras else None

    @property
    def context(self) -> int:
        return self.model.config.max_seq_len

    def encode(self, text: str, add_special_tokens: bool = True) -> list[int]:
        return list(self.tokenizer.encode(text, add_special_tokens=add_special_tokens))

    def admit(self, count: int) -> None:
        running, waiting = self.engine.counts()
        if running + waiting + count - self.max_concurrency > self.max_queue:
            raise APIError(429, f"{waiting} requests are already waiting (--max-queue {self.max_queue}); retry later",
                           code="queue_full", headers={"Retry-After": "1"})


def build_app(folder: str | Path, api_key: str | None = None, max_concurrency: int = 16, max_queue: int = 256,
              cors_origins: list[str] | None = None, max_body: int = 4 << 20, prefill_chunk: int = 2048,
              model_name: str | None = None, rag: str | Path | None = None, access_log=None, device=None,
              cache_memory: int | None = 0, loras: dict[str, str] | None = None, dtype=None,
              encoder_dtype=None, engine_process: bool = False) -> FastAPI:
    """`access_log`: a text stream that gets one line per request (None: no log); `cache_memory`, `loras`, `dtype`,
    `encoder_dtype`, `engine_process`: see `Server`."""
    server = Server(folder, max_concurrency, max_queue, prefill_chunk, model_name, rag, device, cache_memory=cache_memory,
                    loras=loras, dtype=dtype, encoder_dtype=encoder_dtype, engine_process=engine_process)

    async def lifespan(app):
        if not server.ready.is_set():
            threading.Thread(target=server.load, name="lmkit-load", daemon=True).start()
        yield
        if server.engine is not None:
            server.engine.shutdown()

    app = FastAPI(title="lmkit", lifespan=lifespan, docs_url=None, redoc_url=None, openapi_url=None)
    app.state.server = server
    if cors_origins:
        from fastapi.middleware.cors import CORSMiddleware

        app.add_middleware(CORSMiddleware, allow_origins=list(cors_origins), allow_methods=["*"],
                           allow_headers=["*"])

    if api_key:
        app.add_middleware(BearerGuard, api_key=api_key)
    if access_log is not None:
        app.add_middleware(AccessLog, out=access_log)  # the outermost: it times and logs 401s too

    @app.exception_handler(APIError)
    async def api_error(_request, exc: APIError):
        return error_response(exc)

    @app.exception_handler(LmkitError)
    async def lmkit_error(_request, exc: LmkitError):  # a setting generate refuses is the client's mistake
        return error_response(APIError(400, str(exc), code="invalid_value"))

    @app.exception_handler(404)
    async def not_found(request, _exc):
        return error_response(APIError(404, f"no route {request.url.path}", code="not_found"))

    @app.exception_handler(405)
    async def wrong_method(request, exc):
        allow = {k.lower(): v for k, v in (getattr(exc, "headers", None) or {}).items()}.get("allow")
        return error_response(APIError(405, f"{request.method} is not allowed on {request.url.path}"
                                            + (f"; use {allow}" if allow else ""), code="method_not_allowed",
                                       headers={"Allow": allow} if allow else None))

    register_lora(app, server, max_body)

    @app.get("/health")
    async def health():
        server.check_ready()
        return {"status": "ok"}

    @app.get("/metrics")
    async def metrics():
        return Response(server.metrics.text(), media_type="text/plain; version=0.0.4; charset=utf-8")

    @app.get("/v1/models")
    async def models():
        server.check_ready()
        return {"object": "list", "data": model_cards(server, {
            "id": server.model_name, "object": "model", "created": 0, "owned_by": "lmkit",
            "max_model_len": _max_len(server), "sampling_defaults": server.sampling_defaults})}

    @app.get("/")
    async def page():
        return FileResponse(STATIC / "index.html", media_type="text/html")

    @app.get("/static/{name}")
    async def static(name: str):
        path = STATIC / name
        if name not in {p.name for p in STATIC.iterdir()}:
            raise APIError(404, f"no file {name}", code="not_found")
        return FileResponse(path)

    @app.post("/v1/completions")
    async def completions(request: Request):
        return await _generate(server, request, await read_json(request, max_body), chat=False)

    @app.post("/v1/chat/completions")
    async def chat_completions(request: Request):
        return await _generate(server, request, await read_json(request, max_body), chat=True)

    @app.post("/v1/embeddings")
    async def embeddings(request: Request):
        body = check_fields(await read_json(request, max_body), {"input", "model", "encoding_format", "user"})
        server.check_ready()
        server.check_model(body)
        if server.encoder is None:
            raise APIError(400, "this server holds a generative model; serve an encoder or sentence-transformers "
                                "folder for embeddings", param="model", code="not_an_encoder")
        texts = body.get("input")
        texts = [texts] if isinstance(texts, str) else texts
        if not isinstance(texts, list) or not texts or any(not isinstance(t, str) for t in texts):
            raise APIError(400, "input must be a string or a non-empty list of strings", param="input")
        encoding = body.get("encoding_format") or "float"
        if encoding not in ("float", "base64"):
            raise APIError(400, "encoding_format must be float or base64", param="encoding_format")
        vectors = await run_in_threadpool(server.encoder.encode, texts)
        data = [{"object": "embedding", "index": i,
                 "embedding": base64.b64encode(v.astype("<f4").tobytes()).decode() if encoding == "base64"
                 else v.tolist()} for i, v in enumerate(vectors)]
        tokens = sum(len(server.encoder.tokenizer.encode(t)) for t in texts) if server.tokenizer is not None else 0
        return {"object": "list", "data": data, "model": server.model_name,
                "usage": {"prompt_tokens": tokens, "total_tokens": tokens}}

    @app.post("/tokenize")
    async def tokenize(request: Request):
        body = check_fields(await read_json(request, max_body), {"prompt", "add_special_tokens", "model", "messages",
                                                                 "add_generation_prompt"})
        server.check_ready()
        if "messages" in body:
            tokens = chat_prompt(server, parse_messages(body), flag(body, "add_generation_prompt"))
        elif isinstance(body.get("prompt"), str):
            add = body.get("add_special_tokens", True)
            tokens = server.encode(body["prompt"], add_special_tokens=bool(add))
        else:
            raise APIError(400, "prompt must be a string (or give messages)", param="prompt")
        return {"tokens": tokens, "count": len(tokens), "max_model_len": _max_len(server)}

    @app.post("/detokenize")
    async def detokenize(request: Request):
        body = check_fields(await read_json(request, max_body), {"tokens", "model"})
        server.check_ready()
        tokens = body.get("tokens")
        vocab = server.tokenizer.vocab_size
        if not isinstance(tokens, list) or any(isinstance(t, bool) or not isinstance(t, int) or not 0 <= t < vocab
                                               for t in tokens):
            raise APIError(400, f"tokens must be a list of token ids below {vocab}", param="tokens")
        return {"prompt": server.tokenizer.decode(tokens)}

    @app.get("/tokenizer_info")
    async def tokenizer_info():
        server.check_ready()
        return _tokenizer_info(server)

    return app


def _load(folder: Path, dtype, device, engine_process: bool):
    """The decoder the server checks requests against: with the engine in a child process only its skeleton (config,
    shapes, generation defaults on the meta device: the child holds the weights), else the model itself."""
    if engine_process:
        from lmkit.hub import load_skeleton

        return load_skeleton(folder, dtype)
    return lmkit.load_model(folder, dtype=dtype, device=device)


def _max_len(server: Server) -> int | None:
    return server.model.config.max_seq_len if server.model is not None else None


def _tokenizer_info(server: Server) -> dict:
    path = server.folder / "tokenizer_config.json"
    config = json.loads(path.read_text(encoding="utf-8")) if path.is_file() else {}
    tok = server.tokenizer

    def name(key: str, token_id):
        value = config.get(key)
        if isinstance(value, dict):
            value = value.get("content")
        if value is None and token_id is not None:
            value = tok.id_to_token(token_id)
        return value

    eos_id = getattr(tok, "eos_token_id", None)
    if eos_id is None and server.model is not None:
        eos_id = server.model.config.eos_token_id
    return {"tokenizer_class": config.get("tokenizer_class", "PreTrainedTokenizerFast"),
            "eos_token": name("eos_token", eos_id), "bos_token": name("bos_token", getattr(tok, "bos_token_id", None)),
            "pad_token": name("pad_token", getattr(tok, "pad_token_id", None)),
            "chat_template": getattr(tok, "chat_template", None), "model_max_length": _max_len(server),
            "vocab_size": tok.vocab_size}


async def _generate(server: Server, http: Request, body, chat: bool):
    body = check_fields(body, (CHAT_FIELDS if chat else COMPLETION_FIELDS) | STRUCTURED_FIELDS)
    server.check_ready()
    adapter = server.check_model(body)
    if server.engine is None:
        raise APIError(400, "this server holds an encoder; it answers /v1/embeddings only", code="not_generative")
    vocab, sources, tools = server.model.config.vocab_size, None, None
    if chat:
        if body.get("max_completion_tokens") is not None:
            body = {**body, "max_tokens": body["max_completion_tokens"]}
        sampling = parse_sampling(body, vocab, None, server.sampling_defaults, least_max_tokens=1)
        messages, sources = parse_messages(body), None
        tools = parse_tools(body, getattr(server.tokenizer, "chat_template", None))
        if server.rag is not None:  # the last user turn answered from numbered sources of the index
            messages, sources = await run_in_threadpool(ground, server, messages, sampling.max_tokens)
        prompts = [chat_prompt(server, messages, tools=body["tools"] if tools is not None else None)]
        echo = False
    else:
        sampling = parse_sampling(body, vocab, 16, server.sampling_defaults)
        best_of = body.get("best_of")
        if best_of is not None and best_of != sampling.n:
            raise APIError(400, "best_of must equal n when given", param="best_of")
        echo = flag(body, "echo")
        prompts = (parse_prompts(body, vocab, server.encode) if body.get("suffix") is None else
                   parse_infill(body, server.tokenizer, server.model.config.bos_token_id))
    logprobs = parse_logprobs(body, chat)
    grammar = await run_in_threadpool(compile_structured, server, body)  # compiled once per grammar, then kept
    if tools is not None and tools.forced:
        if grammar is not None:
            raise APIError(400, "tool_choice: a forced tool call is its own structured output; leave response_format "
                                "and guided_* out", param="tool_choice", code="invalid_value")
        grammar = await run_in_threadpool(compile_grammar, server, "tools", tools.grammar())
    if grammar is not None and sampling.ignore_eos:
        raise APIError(400, "ignore_eos: a structured output ends at the end token once complete; leave ignore_eos "
                            "out", param="ignore_eos", code="invalid_value")
    lengths = []
    for prompt in prompts:
        wanted = sampling.max_tokens if sampling.max_tokens is not None else server.context - len(prompt)
        if chat and wanted <= 0:
            raise APIError(400, f"the prompt ({len(prompt)} tokens) fills the model's context of {server.context}",
                           param="messages", code="context_length_exceeded")
        check_context(prompt, wanted, server.context)
        if sampling.min_tokens > wanted:
            raise APIError(400, f"min_tokens ({sampling.min_tokens}) must be at most max_tokens ({wanted})",
                           param="min_tokens", code="invalid_value")
        lengths.append(wanted)
    generation = Generation(server, prompts, sampling, lengths, logprobs, echo, chat, grammar, tools, adapter=adapter)
    server.admit(len(generation.choices))
    generation.submit()
    endpoint = "chat" if chat else "completions"
    if sampling.stream:
        server.metrics.requests.labels(endpoint, "200").inc()
        stream = generation.stream() if sources is None else with_sources(generation.stream(), sources)
        return StreamingResponse(stream, media_type="text/event-stream",
                                 headers={"Cache-Control": "no-cache"})
    try:
        answer = await generation.complete(http.is_disconnected)
    finally:
        generation.cancel()
    server.metrics.requests.labels(endpoint, "200").inc()
    return answer if sources is None else {**answer, **sources}
