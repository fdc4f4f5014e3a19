"""Grounded answers: retrieved chunks as numbered sources in the prompt, a decoder's greedy answer, the sources it cites.

The prompt is one user turn: an instruction, the sources "[n] (document id)" then their text, and the
question. A folder with a chat template renders it through `apply_chat_template(add_generation_prompt=True)`;
one without gets the plain text ending in "Answer:". When the prompt and the answer's tokens do not fit
the model's context, sources are dropped from the lowest rank first, each drop reported in `notices`.
Citations are the "[n]" marks of the answer that name a source given.
"""
from __future__ import annotations

import re
from dataclasses import dataclass, field

import lmkit
from lmkit.errors import GenerationError
from lmkit.rag.retrieve import Hit, retrieve

INSTRUCTION = ("Answer the question using only the numbered sources below. Cite the sources you use by their "
               "number in brackets, like [1]. If the sources do not contain the answer, say so.")
CITATION = re.compile(r"\[(\d+)\]")


@dataclass
class Answer:
    prompt: str
    answer: str
    sources: list[Hit]
    cited: list[int]
    notices: list[str] = field(default_factory=list)


def user_message(question: str, sources: list[Hit], instruction: str = INSTRUCTION) -> str:
    """The grounded turn: the instruction (left out when empty), the numbered sources, the question."""
    parts = [instruction, ""] if instruction else []
    for number, hit in enumerate(sources, 1):
        parts += [f"[{number}] ({hit.source})", " ".join(hit.text.split()), ""]
    parts.append(f"Question: {question}")
    return "\n".join(parts)


def grounded_prompt(tokenizer, question: str, sources: list[Hit], instruction: str = INSTRUCTION) -> tuple[str, list[int]]:
    """(prompt text, its ids): through the tokenizer's chat template when it has one."""
    message = user_message(question, sources, instruction)
    if tokenizer.chat_template:
        text = tokenizer.apply_chat_template([{"role": "user", "content": message}], add_generation_prompt=True,
                                             tokenize=False)
        return text, tokenizer.encode(text, add_special_tokens=False)
    text = message + "\nAnswer:"
    return text, tokenizer.encode(text, add_special_tokens=True)


def citations(answer: str, n_sources: int) -> list[int]:
    """The source numbers cited in `answer`, in order of first mention, within 1..n_sources."""
    seen: list[int] = []
    for m in CITATION.finditer(answer):
        n = int(m.group(1))
        if 1 <= n <= n_sources and n not in seen:
            seen.append(n)
    return seen


def grounded_messages(messages: list[dict], sources: list[Hit]) -> list[dict]:
    """A chat with its last user turn replaced by that question grounded in the numbered sources."""
    last = max((i for i, m in enumerate(messages) if m.get("role") == "user"), default=None)
    if last is None:
        return list(messages)
    question = messages[last].get("content")
    return [*messages[:last], {**messages[last], "content": user_message(str(question), sources)},
            *messages[last + 1:]]


def fit_sources(render, hits: list[Hit], room: int) -> tuple[object, list[int], list[Hit], list[str]]:
    """render(kept) -> (prompt, ids) with as many of the best hits as fit in `room` tokens, dropping from the
    lowest rank; returns (prompt, ids, kept, notices)."""
    notices, kept = [], list(hits)
    while True:
        prompt, ids = render(kept)
        if len(ids) <= room:
            return prompt, ids, kept, notices
        if not kept:
            raise GenerationError(f"the question alone takes {len(ids)} tokens, more than the {room} the model's "
                                  "context leaves beside the answer; ask a shorter question or lower --max-new-tokens")
        dropped = kept.pop()
        notices.append(f"source {len(kept) + 1} ({dropped.source}) dropped: the prompt did not fit the model's "
                       f"context ({len(ids)} tokens for {room})")


def answer(index, model_dir, question: str, k: int = 5, mode: str = "hybrid", max_new_tokens: int = 128,
           model=None, tokenizer=None, device=None) -> Answer:
    """Retrieve k chunks from `index` (a RagIndex), prompt the decoder in model_dir with them, decode greedily;
    the decoder runs on device (None: the CPU) unless a loaded `model` is given."""
    import torch


    if max_new_tokens < 1:
        raise GenerationError(f"--max-new-tokens must be at least 1, got {max_new_tokens}")
    model = model if model is not None else lmkit.load_model(model_dir, device=device)
    tokenizer = tokenizer if tokenizer is not None else lmkit.load_tokenizer(model_dir)
    if model.config.architecture != "decoder":
        raise GenerationError(f"{model_dir} is not a decoder-only model; `lmkit rag ask` answers with a decoder")
    hits = retrieve(index, question, k, mode)
    room = model.config.max_seq_len - max_new_tokens
    text, ids, kept, notices = fit_sources(lambda kept: grounded_prompt(tokenizer, question, kept), hits, room)
    eos = tokenizer.eos_token_id if tokenizer.eos_token_id is not None else model.config.eos_token_id
    out = model.generate(torch.tensor([ids]), max_new_tokens=max_new_tokens, do_sample=False, eos_token_id=eos,
                         pad_token_id=model.config.pad_token_id if model.config.pad_token_id is not None else eos)
    reply = tokenizer.decode(out[0, len(ids):].tolist(), skip_special_tokens=True).strip()
    return Answer(text, reply, kept, citations(reply, len(kept)), notices)
