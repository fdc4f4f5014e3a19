"""Held-out answer quality of instruction tuning: ROUGE-L F1 of greedy answers against the reference answers.

A model with a chat template is asked through it; a base model is asked as plain text, zero-shot
("Question: Q\nAnswer:") or few-shot (the same with k solved training pairs before it), its answer cut at the
first blank line or "Question:".
"""
from __future__ import annotations

import torch

from lmkit.chat_session import stop_ids
from lmkit.evaluate.rouge import rouge_l, rouge_tokens


def _qa(row: dict) -> tuple[str, str]:
    user = next(m["content"] for m in row["messages"] if m["role"] == "user")
    answer = next(m["content"] for m in row["messages"] if m["role"] == "assistant")
    return user, answer


def plain_prompt(question: str, shots: list[dict] = ()) -> str:
    solved = "".join(f"Question: {q}\nAnswer: {a}\n\n" for q, a in map(_qa, shots))
    return f"{solved}Question: {question}\nAnswer:"


@torch.no_grad()
def answer(model, tok, question: str, chat: bool, shots: list[dict] = (), bos_id: int | None = None,
           max_new_tokens: int = 48) -> str:
    """The model's greedy answer to `question` (chat: through the template; else a plain prompt)."""
    if chat:
        ids = tok.apply_chat_template([{"role": "user", "content": question}], add_generation_prompt=True,
                                      return_dict=False)
        stops = stop_ids(tok)
    else:
        ids = ([bos_id] if bos_id is not None else []) + tok.encode(plain_prompt(question, shots),
                                                                    add_special_tokens=False)
        stops = [i for i in (tok.eos_token_id, bos_id) if i is not None]
    room = model.config.max_seq_len - max_new_tokens
    ids = ids[-room:]  # a long few-shot prompt keeps its end: the question
    out = model.generate(torch.tensor([ids]), max_new_tokens=max_new_tokens, do_sample=False,
                         eos_token_id=stops or None, pad_token_id=stops[0] if stops else None)
    text = tok.decode([i for i in out[0, len(ids):].tolist() if i not in stops], skip_special_tokens=True)
    if not chat:
        text = text.split("\n\n")[0].split("Question:")[0]
    return text.strip()


def answer_rouge(model, tok, rows: list[dict], chat: bool, shots: list[dict] = (), bos_id: int | None = None,
                 max_new_tokens: int = 48) -> tuple[float, list[str]]:
    """(mean ROUGE-L F1 over `rows`, the answers)."""
    answers, total = [], 0.0
    for row in rows:
        question, reference = _qa(row)
        a = answer(model, tok, question, chat, shots, bos_id, max_new_tokens)
        answers.append(a)
        total += rouge_l(rouge_tokens(a), rouge_tokens(reference))
    return total / max(len(rows), 1), answers
