"""Grounded answers: retrieved chunks as numbered sources in the prompt, a decoder's greedy answer, the sources it cites.

The prompt is one user turn: an instruction, the sources "[n] (document id)" then their text, and the
question. A folder with a chat template renders it through `apply_chat_template(add_generation_prompt=True)`;
one without gets the plain text ending in "Answer:". When the prompt and the answer's tokens do not fit
the model's context, sources are dropped from the lowest rank first, the best one cut to fit when it alone
is too long, each step reported in `notices` (`lmkit.rag.fit`); with no source left the answer is refused
unless allowed, then asked without sources and marked ungrounded. Citations are the "[n]" marks of the answer
that name a source given.
"""
from __future__ import annotations

import re
from dataclasses import dataclass, field

import lmkit
from lmkit.errors import GenerationError
from lmkit.rag.fit import Fitted, Room, default_answer_tokens, fit_sources
from lmkit.rag.retrieve import Hit, retrieve

INSTRUCTION = ("Answer the question using only the numbered sources below. Cite the sources you use by their "
               "number in brackets, like [1]. If the sources do not contain the answer, say so.")
# for a short context: where the full instruction leaves no room for a source, this one may
SHORT_INSTRUCTION = "Answer from the numbered sources; cite them like [1]."
CITATION = re.compile(r"\[(\d+)\]")


@dataclass
class Answer:
    prompt: str
    answer: str
    sources: list[Hit]
    cited: list[int]
    notices: list[str] = field(default_factory=list)

    @property
    def grounded(self) -> bool:
        """Whether any source was in the prompt (False only when the caller allowed an ungrounded answer)."""
        return bool(self.sources)


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


def grounded_messages(messages: list[dict], sources: list[Hit], instruction: str = INSTRUCTION) -> list[dict]:
    """A chat with its last user turn replaced by that question grounded in the numbered sources."""
    last = max((i for i, m in enumerate(messages) if m.get("role") == "user"), default=None)
    if last is None:
        return list(messages)
    question = messages[last].get("content")
    return [*messages[:last], {**messages[last], "content": user_message(str(question), sources, instruction)},
            *messages[last + 1:]]


def prompt_parts(tokenizer, question: str, instruction: str = INSTRUCTION) -> dict[str, int]:
    """Token counts of the named pieces of a grounded prompt (for messages about room)."""
    def count(text: str) -> int:
        return len(tokenizer.encode(text, add_special_tokens=False))

    return {"the question": count(f"Question: {question}"), "the instruction": count(instruction)}


def fit_grounded(render, hits: list[Hit], room: Room, tokenizer, question: str, rest: str = "the template",
                 allow_ungrounded: bool = False) -> Fitted:
    """`fit_sources` for render(sources, instruction) -> (prompt, ids): with INSTRUCTION, and where that leaves
    no room for a source, with SHORT_INSTRUCTION (noted); allowed ungrounded, the question alone is asked."""
    for instruction in (INSTRUCTION, SHORT_INSTRUCTION):
        last = instruction == SHORT_INSTRUCTION
        try:
            fitted = fit_sources(lambda kept: render(kept, instruction), hits, room, tokenizer,
                                 parts=prompt_parts(tokenizer, question, instruction), rest=rest,
                                 allow_ungrounded=allow_ungrounded and last, ungrounded=lambda: render([], ""))
        except GenerationError:
            if last:
                raise
            continue
        if last and fitted.sources:
            fitted.notices.append("the instruction was shortened to leave room for a source")
        return fitted
    raise AssertionError("unreachable")


def answer(index, model_dir, question: str, k: int = 5, mode: str = "hybrid", max_new_tokens: int | None = None,
           model=None, tokenizer=None, allow_ungrounded: bool = False, device=None) -> Answer:
    """Retrieve k chunks from `index` (a RagIndex), prompt the decoder in model_dir with them, decode greedily.

    max_new_tokens defaults to `default_answer_tokens` of the model's context (128, or a quarter of a short
    context). Where the full instruction leaves no source room, SHORT_INSTRUCTION is tried; with no source
    fitting even then, UngroundedError unless allow_ungrounded (then the bare question is asked). The decoder
    runs on `device` (None: the CPU) unless a loaded `model` is given.
    """
    import torch

    model = model if model is not None else lmkit.load_model(model_dir, device=device)
    tokenizer = tokenizer if tokenizer is not None else lmkit.load_tokenizer(model_dir)
    if model.config.architecture != "decoder":
        raise GenerationError(f"{model_dir} is not a decoder-only model; `lmkit rag ask` answers with a decoder")
    context = model.config.max_seq_len
    room = Room(context, default_answer_tokens(context) if max_new_tokens is None else max_new_tokens)
    room.check()
    hits = retrieve(index, question, k, mode)
    fitted = fit_grounded(lambda kept, instruction: grounded_prompt(tokenizer, question, kept, instruction), hits,
                          room, tokenizer, question, allow_ungrounded=allow_ungrounded)
    ids = fitted.ids
    eos = tokenizer.eos_token_id if tokenizer.eos_token_id is not None else model.config.eos_token_id
    out = model.generate(torch.tensor([ids]), max_new_tokens=room.answer, do_sample=False, eos_token_id=eos,
                         pad_token_id=model.config.pad_token_id if model.config.pad_token_id is not None else eos)
    reply = tokenizer.decode(out[0, len(ids):].tolist(), skip_special_tokens=True).strip()
    return Answer(fitted.prompt, reply, fitted.sources, citations(reply, len(fitted.sources)), fitted.notices)
