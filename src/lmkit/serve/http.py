"""The server's HTTP plumbing below the routes: request bodies read within a limit, OpenAI's error responses, the
API-key guard and the access log (plain ASGI middleware: Starlette's BaseHTTPMiddleware would carry every streamed
event through a memory stream and a task of its own)."""
from __future__ import annotations

import hmac
import json
import sys
import time

from fastapi import Request
from fastapi.responses import JSONResponse

from lmkit.serve.protocol import APIError


def error_response(exc: APIError) -> JSONResponse:
    return JSONResponse(exc.body(), status_code=exc.status, headers=exc.headers)


async def read_json(request: Request, limit: int):
    declared = request.headers.get("content-length")
    if declared is not None and declared.isdigit() and int(declared) > limit:
        raise APIError(413, f"the request body is over {limit} bytes", code="body_too_large")
    size, parts = 0, []
    async for part in request.stream():
        size += len(part)
        if size > limit:
            raise APIError(413, f"the request body is over {limit} bytes", code="body_too_large")
        parts.append(part)
    try:
        return json.loads(b"".join(parts) or b"null")
    except (UnicodeDecodeError, json.JSONDecodeError) as exc:
        raise APIError(400, f"the request body is not valid JSON: {exc}", code="invalid_json") from None


class BearerGuard:
    """401 on /v1/* without `Authorization: Bearer KEY`."""

    def __init__(self, app, api_key: str):
        self.app, self.expected = app, f"Bearer {api_key}".encode()

    async def __call__(self, scope, receive, send):
        if scope["type"] == "http" and scope["path"].startswith("/v1/") and scope["method"] != "OPTIONS":
            given = next((v for k, v in scope["headers"] if k == b"authorization"), b"")
            if not hmac.compare_digest(given, self.expected):
                response = error_response(APIError(401, "a valid API key is needed: Authorization: Bearer KEY",
                                                   code="invalid_api_key"))
                await response(scope, receive, send)
                return
        await self.app(scope, receive, send)


class AccessLog:
    """One line per request once its answer is sent: client, method, path, status, the seconds to the first byte
    of the answer and to its end (a stream's whole length), e.g.
    `127.0.0.1 "POST /v1/chat/completions" 200 first 0.012s total 0.840s`."""

    def __init__(self, app, out=None):
        self.app, self.out = app, out

    async def __call__(self, scope, receive, send):
        if scope["type"] != "http":
            await self.app(scope, receive, send)
            return
        start = time.perf_counter()
        seen = {"status": 500, "first": None}

        async def watch(message):
            if message["type"] == "http.response.start":
                seen["status"] = message["status"]
                seen["first"] = time.perf_counter() - start
            await send(message)

        try:
            await self.app(scope, receive, watch)
        finally:
            client = (scope.get("client") or ("-",))[0]
            first = seen["first"] if seen["first"] is not None else time.perf_counter() - start
            out = self.out or sys.stderr
            out.write(f'{client} "{scope["method"]} {scope["path"]}" {seen["status"]} first {first:.3f}s total '
                      f"{time.perf_counter() - start:.3f}s\n")
            out.flush()
