"""The log-probabilities a served request reports: of each chosen token and its likeliest alternatives
(OpenAI's `logprobs`), and of each prompt token given the ones before it (`echo` with `logprobs`, vLLM's
`prompt_logprobs`)."""
from __future__ import annotations

import torch


def top_logprobs(log_probs: torch.Tensor, n: int, chosen: int) -> dict[int, float]:
    """The n likeliest tokens' log-probabilities, and the chosen token's, from the one tensor."""
    top = torch.topk(log_probs, min(n, log_probs.shape[-1])) if n else None
    out = {} if top is None else dict(zip(top.indices.tolist(), top.values.tolist()))
    out.setdefault(chosen, float(log_probs[chosen]))
    return out


def record_prompt_logprobs(request, logits: torch.Tensor, start: int, end: int) -> None:
    """Append log p(prompt[i] | prompt[:i]) for i in start+1..end to `request` (an engine Request) from the logits
    of its prompt chunk start..end-1 (the next chunk's first token is scored by this chunk's last position)."""
    log_probs = torch.log_softmax(logits, dim=-1)
    if start == 0:
        request.prompt_token_logprobs.append(None)
        request.prompt_top_logprobs.append(None)
    for row, token in enumerate(request.prompt[start + 1:end + 1]):
        request.prompt_token_logprobs.append(float(log_probs[row, token]))
        request.prompt_top_logprobs.append(top_logprobs(log_probs[row], request.prompt_logprobs, token))
