"""`lmkit serve`: an OpenAI-compatible HTTP server for a model folder, with a chat page at /.

Endpoints: /v1/completions, /v1/chat/completions, /v1/embeddings (encoder folders), /v1/models, /health,
/metrics, /tokenize, /detokenize, /tokenizer_info. Binds 127.0.0.1 unless --host says otherwise.
"""
from __future__ import annotations

from lmkit.cli.common import add_device_argument, device_of
from lmkit.errors import ConfigError


def register(subparsers) -> None:
    p = subparsers.add_parser("serve", help="serve a model over an OpenAI-compatible HTTP API", description=__doc__)
    p.add_argument("--model", required=True, metavar="DIR", help="model folder (config.json, weights, tokenizer)")
    p.add_argument("--host", default="127.0.0.1", help="address to bind (default 127.0.0.1: this machine only)")
    p.add_argument("--port", type=int, default=8000, help="port (default 8000)")
    p.add_argument("--api-key", default=None, metavar="KEY", help="require Authorization: Bearer KEY on /v1/*")
    p.add_argument("--max-concurrency", type=int, default=16, metavar="N",
                   help="sequences decoded together; more wait (default 16)")
    p.add_argument("--max-queue", type=int, default=256, metavar="N",
                   help="requests that may wait; more get 429 with Retry-After (default 256)")
    p.add_argument("--prefill-chunk", type=int, default=256, metavar="N",
                   help="prompt tokens prefilled per step, across requests (default 256)")
    p.add_argument("--cors-origins", nargs="*", default=None, metavar="ORIGIN",
                   help="allow browser pages from these origins (default: no CORS headers)")
    p.add_argument("--max-body", type=int, default=4 << 20, metavar="BYTES", help="largest request body (413 past it)")
    p.add_argument("--model-name", default=None, help="the model id /v1/models reports (default: the folder's name)")
    p.add_argument("--rag", default=None, metavar="INDEX",
                   help="answer chat turns from an `lmkit rag index` folder: sources returned beside the message")
    add_device_argument(p)
    p.set_defaults(func=run)


def run(args) -> int:
    import sys
    from pathlib import Path

    import uvicorn

    from lmkit.serve import build_app

    if not Path(args.model).is_dir():
        raise ConfigError(f"--model {args.model} is not a folder; give a model folder (config.json, weights, tokenizer)")
    if args.max_concurrency < 1 or args.max_queue < 0 or args.prefill_chunk < 1:
        raise ConfigError("--max-concurrency and --prefill-chunk must be >= 1 and --max-queue >= 0")
    # the engine's thread re-takes the GIL after every torch call; with the default 5 ms switch interval a busy event
    # loop (many streams) would keep it waiting up to that long each time
    sys.setswitchinterval(0.0002)
    app = build_app(args.model, api_key=args.api_key, max_concurrency=args.max_concurrency, max_queue=args.max_queue,
                    cors_origins=args.cors_origins, max_body=args.max_body, prefill_chunk=args.prefill_chunk,
                    model_name=args.model_name, rag=args.rag, device=device_of(args))
    uvicorn.run(app, host=args.host, port=args.port, log_level="warning")
    return 0
