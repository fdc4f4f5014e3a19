"""`lmkit serve`: an OpenAI-compatible HTTP server for a model folder, with a chat page at /.

Endpoints: /v1/completions, /v1/chat/completions, /v1/embeddings (encoder folders), /v1/models, /health,
/metrics, /tokenize, /detokenize, /tokenizer_info. Binds 127.0.0.1 unless --host says otherwise.
"""
from __future__ import annotations

from lmkit.cli.helptext import add_command
from lmkit.cli.common import add_device_argument, device_of
from lmkit.errors import ConfigError


def register(subparsers) -> None:
    p = add_command(subparsers, "serve", help="serve a model over an OpenAI-compatible HTTP API", description=__doc__,
                    example_lines=("lmkit serve --model runs/demo/sft          # then open http://127.0.0.1:8000/",
                                   "lmkit serve --model runs/demo/sft --port 8080 --api-key secret --rag pyidx"))
    p.add_argument("--model", required=True, metavar="DIR", help="model folder (config.json, weights, tokenizer)")
    p.add_argument("--host", default="127.0.0.1", metavar="ADDRESS", help="address to bind (default 127.0.0.1: this machine only)")
    p.add_argument("--port", type=int, default=8000, metavar="N", help="port (default 8000)")
    p.add_argument("--api-key", default=None, metavar="KEY", help="require Authorization: Bearer KEY on /v1/* (default: no key)")
    p.add_argument("--max-concurrency", type=int, default=16, metavar="N",
                   help="sequences decoded together; more wait (default 16)")
    p.add_argument("--max-queue", type=int, default=256, metavar="N",
                   help="requests that may wait; more get 429 with Retry-After (default 256)")
    p.add_argument("--prefill-chunk", type=int, default=2048, metavar="N",
                   help="tokens a step: one per running stream, prompt chunks in the rest, as vLLM's "
                        "--max-num-batched-tokens (default 2048, vLLM's on CPU)")
    p.add_argument("--cors-origins", nargs="*", default=None, metavar="ORIGIN",
                   help="allow browser pages from these origins (default: no CORS headers)")
    p.add_argument("--max-body", type=int, default=4 << 20, metavar="BYTES", help="largest request body; past it the answer is 413 (default "
                   "4194304, 4 MiB)")
    p.add_argument("--model-name", default=None, metavar="NAME", help="the model id /v1/models reports (default: the folder's name)")
    p.add_argument("--quiet", action="store_true",
                   help="no access log (default: one line per request on stderr with status and seconds)")
    p.add_argument("--rag", default=None, metavar="INDEX",
                   help="answer chat turns from an `lmkit rag index` folder: sources returned beside the message "
                        "(default: no retrieval)")
    p.add_argument("--cache-memory", type=float, default=None, metavar="GIB",
                   help="GiB of keys and values kept for later requests that share a prompt prefix (automatic prefix "
                        "caching, least recently used evicted); 0: off (default: 1 GiB, or one full context where "
                        "that is more)")
    p.add_argument("--lora", nargs="+", action="extend", default=None, metavar="NAME=DIR",
                   help="serve the LoRA adapter in DIR (PEFT format) as model NAME beside the base, per request; "
                        "more at run time with POST /v1/load_lora_adapter (default: none)")
    p.add_argument("--dtype", default="auto", choices=("auto", "bf16", "fp32"), metavar="auto|bf16|fp32",
                   help="the weights' precision (default auto: a decoder in bf16 where the device computes it natively, "
                        "as training's --precision default, else fp32; an embedding folder stays fp32 unless bf16)")
    engine = p.add_mutually_exclusive_group()
    engine.add_argument("--engine-process", dest="engine", action="store_const", const="process", default="process",
                        help="the default: the model and the engine run in a child process, as vLLM's EngineCore (the "
                             "HTTP process holds no weights and keeps its interpreter lock to itself; a crashed engine "
                             "answers 503 and is restarted)")
    engine.add_argument("--engine-thread", dest="engine", action="store_const", const="thread",
                        help="run the engine in a thread of the HTTP process instead (one process; its OpenMP "
                             "workers wait passively: slower on cores the server has to itself, steadier on a busy "
                             "machine, where OMP_WAIT_POLICY=PASSIVE does the same for the default) (default: off)")
    add_device_argument(p)
    p.set_defaults(func=run)


def run(args) -> int:
    import sys
    from pathlib import Path

    import uvicorn

    from lmkit.serve import build_app
    from lmkit.serve.lora import parse_loras

    if not Path(args.model).is_dir():
        raise ConfigError(f"--model {args.model} is not a folder; give a model folder (config.json, weights, tokenizer)")
    if args.max_concurrency < 1 or args.max_queue < 0 or args.prefill_chunk < 1:
        raise ConfigError("--max-concurrency and --prefill-chunk must be >= 1 and --max-queue >= 0")
    if args.cache_memory is not None and args.cache_memory < 0:
        raise ConfigError("--cache-memory must be >= 0 (GiB; 0 turns prefix caching off)")
    cache_memory = None if args.cache_memory is None else int(args.cache_memory * (1 << 30))
    app = build_app(args.model, api_key=args.api_key, max_concurrency=args.max_concurrency, max_queue=args.max_queue,
                    cors_origins=args.cors_origins, max_body=args.max_body, prefill_chunk=args.prefill_chunk,
                    model_name=args.model_name, rag=args.rag, access_log=None if args.quiet else sys.stderr,
                    device=device_of(args), cache_memory=cache_memory, loras=parse_loras(args.lora),
                    dtype=_dtype(args.dtype, device_of(args)),
                    encoder_dtype=_dtype(args.dtype, device_of(args)) if args.dtype == "bf16" else None,
                    engine_process=args.engine == "process")
    server = app.state.server
    server.load()  # before the port opens: a folder that cannot serve is one line and exit 2, not 503s
    if server.load_error:
        if server.engine is not None:
            server.engine.shutdown()
        raise ConfigError(f"cannot serve {args.model}: {server.load_error}")
    sock = _bind(args.host, args.port)
    # the engine's thread re-takes the GIL after every torch call; with the default 5 ms switch interval a busy event
    # loop (many streams) would keep it waiting up to that long each time
    sys.setswitchinterval(0.0002)
    host = f"[{args.host}]" if ":" in args.host else args.host
    port = sock.getsockname()[1]
    print(f"lmkit serve: {_describe(server)} as {server.model_name!r} at http://{host}:{port}/v1 (chat page: "
          f"http://{host}:{port}/){'; requests are logged (--quiet: off)' if not args.quiet else ''}; Ctrl-C stops",
          flush=True)
    uvicorn.Server(uvicorn.Config(app, log_level="warning", access_log=False)).run(sockets=[sock])
    return 0


def _bind(host: str, port: int):
    """A listening socket on host:port; a ConfigError naming the port when it is taken or not this machine's."""
    import errno
    import socket

    try:
        sock = socket.socket(socket.AF_INET6 if ":" in host else socket.AF_INET, socket.SOCK_STREAM)  # as uvicorn
        sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)  # as uvicorn: a restart reuses a port in TIME_WAIT
        sock.bind((host, port))
        sock.listen(2048)
    except OSError as exc:
        if exc.errno == errno.EADDRINUSE:
            raise ConfigError(f"port {port} on {host} is already in use (another server?); stop it or choose "
                              "another with --port") from None
        raise ConfigError(f"cannot listen on {host}:{port} ({exc.strerror or exc}); check --host and --port") from None
    sock.set_inheritable(True)
    return sock


def _dtype(name: str, device):
    """--dtype as a torch dtype (None: float32); auto follows training's rule (`default_precision`)."""
    import torch

    from lmkit.train.precision import default_precision

    if name == "auto":
        name = default_precision(device)
    return torch.bfloat16 if name == "bf16" else None


def _describe(server) -> str:
    """The served folder in a few words: its kind, context and precision."""
    if server.model is None:
        precision = "bf16" if server.encoder_dtype is not None else "fp32"
        return f"{server.folder} (embeddings, {precision})"
    precision = "bf16" if server.dtype is not None else "fp32"
    prefix = server.engine.prefix
    cache = f"prefix cache {prefix.budget / (1 << 30):.2f} GiB" if prefix is not None else "no prefix cache"
    adapters = f", LoRA adapters {', '.join(server.loras)}" if server.loras else ""
    engine = "engine in a child process" if getattr(server.engine, "remote", False) else "engine in a thread"
    return f"{server.folder} ({server.model.config.max_seq_len} positions, {precision}, {cache}{adapters}, {engine})"
