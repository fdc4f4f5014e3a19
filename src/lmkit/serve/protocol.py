"""OpenAI request bodies checked field by field, and OpenAI's error body.

Every bad input becomes an `APIError` (400 with `{"error": {"message", "type", "param", "code"}}`) rather than an
exception deep in decoding: clients retry 5xx responses, so a bad request must never produce one.
"""
from __future__ import annotations

import math
from dataclasses import dataclass, field

from lmkit.generation import GenerationConfig


class APIError(Exception):
    """An HTTP error answered with OpenAI's error body."""

    TYPES = {400: "invalid_request_error", 401: "authentication_error", 404: "not_found_error",
             413: "invalid_request_error", 429: "rate_limit_error", 503: "service_unavailable"}

    def __init__(self, status: int, message: str, param: str | None = None, code: str | None = None,
                 headers: dict | None = None, kind: str | None = None):
        """`kind`: the error's type where it is not the status's usual one."""
        super().__init__(message)
        self.status, self.message, self.param, self.code, self.headers = status, message, param, code, headers or {}
        self.kind = kind or self.TYPES.get(status, "invalid_request_error")

    def body(self) -> dict:
        return {"error": {"message": self.message, "type": self.kind,
                          "param": self.param, "code": self.code}}


SAMPLING_FIELDS = {"model", "max_tokens", "temperature", "top_p", "top_k", "min_p", "n", "stop", "seed",
                   "presence_penalty", "frequency_penalty", "repetition_penalty", "logit_bias", "stream",
                   "stream_options", "user", "ignore_eos", "min_tokens"}
COMPLETION_FIELDS = SAMPLING_FIELDS | {"prompt", "logprobs", "echo", "best_of", "suffix"}
CHAT_FIELDS = SAMPLING_FIELDS | {"messages", "max_completion_tokens", "logprobs", "top_logprobs", "tools", "tool_choice",
                                 "parallel_tool_calls"}
ROLES = ("system", "developer", "user", "assistant", "tool")  # the chat roles OpenAI's API (and vLLM) take
MAX_N = 16
MAX_LOGPROBS = 20


def _bad(param: str, message: str) -> APIError:
    return APIError(400, f"{param}: {message}", param=param, code="invalid_value")


def _number(body: dict, name: str, default, low=None, high=None, integer=False):
    value = body.get(name)
    if value is None:
        return default
    kind = (int,) if integer else (int, float)
    if isinstance(value, bool) or not isinstance(value, kind) or (not integer and not math.isfinite(value)):
        raise _bad(name, f"must be {'an integer' if integer else 'a number'}, got {value!r}")
    if (low is not None and value < low) or (high is not None and value > high):
        bounds = f"at least {low}" if high is None else f"at most {high}" if low is None else f"in [{low}, {high}]"
        raise _bad(name, f"must be {bounds}, got {value!r}")
    return value


def flag(body: dict, name: str) -> bool:
    value = body.get(name, False)
    if value is None:
        return False
    if not isinstance(value, bool):
        raise _bad(name, f"must be true or false, got {value!r}")
    return value


@dataclass
class Sampling:
    """The sampling fields every generation endpoint shares, checked."""

    max_tokens: int | None
    temperature: float
    top_p: float
    top_k: int
    min_p: float
    n: int
    stop: list[str]
    seed: int | None
    presence_penalty: float
    frequency_penalty: float
    repetition_penalty: float
    logit_bias: dict[int, float]
    stream: bool
    include_usage: bool
    ignore_eos: bool = False  # vLLM's: EOS neither ends the reply nor is banned (stop strings still apply)
    min_tokens: int = 0  # vLLM's: no end token, and no stop string ending in them, within the first min_tokens
    extra: dict = field(default_factory=dict)

    def generation_config(self, max_new_tokens: int, eos: list[int] | None = None) -> GenerationConfig:
        """OpenAI's meanings in generate's terms: temperature 0 is greedy, no top-k unless asked; `eos`: every id
        the reply stops at (none with ignore_eos)."""
        bias = [[[token], value] for token, value in self.logit_bias.items()] or None
        return GenerationConfig(max_new_tokens=max_new_tokens, do_sample=self.temperature > 0,
                                temperature=self.temperature if self.temperature > 0 else None, top_k=self.top_k,
                                top_p=self.top_p if self.top_p < 1 else None, min_p=self.min_p or None,
                                repetition_penalty=self.repetition_penalty, stop_strings=self.stop or None,
                                sequence_bias=bias, min_new_tokens=self.min_tokens or None,
                                eos_token_id=[] if self.ignore_eos else list(eos) if eos else None)


def check_fields(body, allowed: set[str]) -> dict:
    if not isinstance(body, dict):
        raise APIError(400, "the request body must be a JSON object", code="invalid_json")
    unknown = sorted(set(body) - allowed)
    if unknown:
        raise APIError(400, f"unknown field(s): {', '.join(unknown)}", param=unknown[0], code="unknown_field")
    return body


def parse_sampling(body: dict, vocab_size: int, default_max_tokens: int | None, defaults: dict | None = None,
                   least_max_tokens: int = 0) -> Sampling:
    """The checked sampling fields; one left unset takes `defaults` (the folder's generation_config.json values),
    else OpenAI's default. `least_max_tokens`: the least max_tokens (a completion may ask for 0 to score its prompt)."""
    defaults = defaults or {}
    stop = body.get("stop")
    if stop is None:
        stop = []
    elif isinstance(stop, str):
        stop = [stop]
    if not isinstance(stop, list) or len(stop) > 4 or any(not isinstance(s, str) or not s for s in stop):
        raise _bad("stop", f"must be a non-empty string or a list of at most 4 of them, got {body.get('stop')!r}")
    bias_raw = body.get("logit_bias") or {}
    if not isinstance(bias_raw, dict):
        raise _bad("logit_bias", "must map token ids to biases in [-100, 100]")
    logit_bias = {}
    for key, value in bias_raw.items():
        try:
            token = int(key)
        except (TypeError, ValueError):
            raise _bad("logit_bias", f"{key!r} is not a token id") from None
        if not 0 <= token < vocab_size or isinstance(value, bool) or not isinstance(value, (int, float)) \
                or not -100 <= value <= 100:
            raise _bad("logit_bias", f"token {key} must be below {vocab_size} and its bias in [-100, 100]")
        logit_bias[token] = float(value)
    options = body.get("stream_options")
    if options is not None and (not isinstance(options, dict) or set(options) - {"include_usage"}):
        raise _bad("stream_options", "must be {\"include_usage\": true|false}")
    stream = flag(body, "stream")
    if options is not None and not stream:
        raise _bad("stream_options", "is only allowed with stream: true")
    include_usage = bool((options or {}).get("include_usage", False))
    model = body.get("model")
    if model is not None and not isinstance(model, str):
        raise _bad("model", "must be a string")
    return Sampling(
        max_tokens=_number(body, "max_tokens", default_max_tokens, low=least_max_tokens, integer=True),
        temperature=float(_number(body, "temperature", defaults.get("temperature", 1.0), 0, 2)),
        top_p=float(_number(body, "top_p", defaults.get("top_p", 1.0), 0, 1)),
        top_k=_number(body, "top_k", defaults.get("top_k", 0), -1, integer=True) if body.get("top_k") != -1 else 0,
        min_p=float(_number(body, "min_p", defaults.get("min_p", 0.0), 0, 1)), n=_number(body, "n", 1, 1, MAX_N, integer=True), stop=stop,
        seed=_number(body, "seed", None, -2 ** 63, 2 ** 64 - 1, integer=True),
        presence_penalty=float(_number(body, "presence_penalty", 0.0, -2, 2)),
        frequency_penalty=float(_number(body, "frequency_penalty", 0.0, -2, 2)),
        repetition_penalty=float(_number(body, "repetition_penalty", defaults.get("repetition_penalty", 1.0), 0.01, 10)),
        logit_bias=logit_bias, stream=stream, include_usage=include_usage, ignore_eos=flag(body, "ignore_eos"),
        min_tokens=_number(body, "min_tokens", 0, 0, integer=True))


def parse_prompts(body: dict, vocab_size: int, encode) -> list[list[int]]:
    """`prompt` as a string, a list of strings, a list of ids or a list of lists of ids -> lists of ids."""
    prompt = body.get("prompt")

    def ids(value) -> list[int]:
        if not value or any(isinstance(t, bool) or not isinstance(t, int) or not 0 <= t < vocab_size for t in value):
            raise _bad("prompt", f"token id lists must be non-empty and hold ids in [0, {vocab_size})")
        return list(value)

    if isinstance(prompt, str):
        return [encode(prompt)]
    if isinstance(prompt, list) and prompt:
        if all(isinstance(p, str) for p in prompt):
            return [encode(p) for p in prompt]
        if all(isinstance(p, int) and not isinstance(p, bool) for p in prompt):
            return [ids(prompt)]
        if all(isinstance(p, list) for p in prompt):
            return [ids(p) for p in prompt]
    raise _bad("prompt", "must be a string, a list of strings, a list of token ids or a list of lists of token ids")


def parse_infill(body: dict, tokenizer, bos_id: int | None) -> list[list[int]]:
    """OpenAI's insert mode: `prompt` (a string or a list of them) is the text before the gap, `suffix` the text
    after it -> fill-in-the-middle prompts (lmkit.data.fim); the completion is the middle."""
    from lmkit.data.fim import infill_bos, infill_prompt
    from lmkit.errors import GenerationError

    suffix, prompt = body["suffix"], body.get("prompt", "")
    if not isinstance(suffix, str):
        raise _bad("suffix", f"must be a string, got {suffix!r}")
    prompts = [prompt] if isinstance(prompt, str) else prompt
    if not isinstance(prompts, list) or not prompts or not all(isinstance(p, str) for p in prompts):
        raise _bad("prompt", "with suffix, must be a string or a list of strings (the text before the insertion)")
    if flag(body, "echo"):
        raise _bad("echo", "cannot be used with suffix (insert mode returns the inserted text)")
    try:
        return [infill_prompt(tokenizer, p, suffix, infill_bos(tokenizer, bos_id), where="this model") for p in prompts]
    except GenerationError as exc:
        raise APIError(400, str(exc), param="suffix", code="invalid_value") from None


def parse_logprobs(body: dict, chat: bool) -> int | None:
    """Top-N alternatives per token, or None when no log-probabilities are asked for."""
    if chat:
        if not flag(body, "logprobs"):
            if body.get("top_logprobs") is not None:
                raise _bad("top_logprobs", "needs logprobs: true")
            return None
        return _number(body, "top_logprobs", 0, 0, MAX_LOGPROBS, integer=True)
    return _number(body, "logprobs", None, 0, MAX_LOGPROBS, integer=True)


def parse_messages(body: dict) -> list[dict]:
    messages = body.get("messages")
    if not isinstance(messages, list) or not messages:
        raise _bad("messages", "must be a non-empty list of {\"role\", \"content\"} objects")
    out = []
    for message in messages:
        if not isinstance(message, dict) or not isinstance(message.get("role"), str):
            raise _bad("messages", f"each message needs a string role, got {message!r}")
        if message["role"] not in ROLES:
            raise _bad("messages", f"role {message['role']!r} is not one of {', '.join(ROLES)}")
        content = message.get("content")
        if isinstance(content, list):  # content parts: the text ones, joined
            if any(not isinstance(p, dict) or p.get("type") != "text" or not isinstance(p.get("text"), str)
                   for p in content):
                raise _bad("messages", "only text content parts are supported")
            content = "".join(p["text"] for p in content)
        if content is not None and not isinstance(content, str):
            raise _bad("messages", f"content must be a string or a list of text parts, got {content!r}")
        out.append({**message, "content": content or ""})
    return out
