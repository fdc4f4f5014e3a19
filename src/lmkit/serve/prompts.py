"""The prompt of a chat request: the messages through the folder's chat template, and, on a server with a RAG index,
the last user turn grounded in numbered sources that fit the context."""
from __future__ import annotations

import json

from lmkit.serve.protocol import APIError
from lmkit.serve.tools import template_messages


def chat_prompt(server, messages: list[dict], add_generation_prompt: bool = True,
                tools: list | None = None) -> list[int]:
    """The token ids of a chat request: its messages through the folder's chat template (a 400 without one)."""
    if not getattr(server.tokenizer, "chat_template", None):
        raise APIError(400, f"the folder {server.folder} has no chat template (chat_template.jinja or "
                            "tokenizer_config.json's chat_template); use /v1/completions", param="messages",
                       code="no_chat_template")
    text = server.tokenizer.apply_chat_template(template_messages(messages), tools=tools,
                                                add_generation_prompt=add_generation_prompt, tokenize=False)
    return server.encode(text, add_special_tokens=False)


def ground(server, messages: list[dict], max_tokens: int | None) -> tuple[list[dict], dict]:
    """(messages with the last user turn grounded, {"sources", "notices"}); sources dropped from the lowest rank
    (the best one cut to fit) until the prompt leaves max_tokens of the context (without it, what `rag ask`
    keeps: 128 or a quarter of the context); with no source left, a 400 (code no_source_fits) naming the room."""
    from lmkit.rag.answer import fit_grounded, grounded_messages
    from lmkit.rag.fit import Room, UngroundedError, default_answer_tokens
    from lmkit.rag.retrieve import retrieve

    question = next((m.get("content") for m in reversed(messages) if m.get("role") == "user"), None)
    hits = retrieve(server.rag, str(question), 5) if isinstance(question, str) and question.strip() else []
    room = Room(server.context, max_tokens or default_answer_tokens(server.context), "max_tokens")

    def render(kept, instruction):
        grounded = grounded_messages(messages, kept, instruction)
        return grounded, chat_prompt(server, grounded)

    try:
        fitted = fit_grounded(render, hits, room, server.tokenizer, str(question),
                              rest="the template and the other turns")
    except UngroundedError as exc:
        raise APIError(400, str(exc), param="messages", code="no_source_fits") from exc
    sources = [{"number": n, **hit.to_json()} for n, hit in enumerate(fitted.sources, 1)]
    return fitted.prompt, {"sources": sources, "notices": fitted.notices}


async def with_sources(stream, sources: dict):
    """The chat stream with a first event carrying the sources (no choices, so OpenAI clients skip it)."""
    yield f"data: {json.dumps({'object': 'chat.completion.chunk', 'choices': [], **sources}, ensure_ascii=False)}\n\n"
    async for event in stream:
        yield event
