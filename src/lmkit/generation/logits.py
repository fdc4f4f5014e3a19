"""The math of the logits processors (`generation/processors.py` wraps each in a class and orders them):
penalties, n-gram blocking, forcing and suppressing tokens, and the sampling filters, each equal to
transformers' processor of the same purpose, on scores (B, V) float32. The truncation filters keep at
least `keep` tokens: 1, or in beam sampling one more than the EOS tokens (2 without any), as transformers does.
"""
from __future__ import annotations

import torch

from lmkit.errors import GenerationError

NEG_INF = -float("inf")


def repetition_penalty(sequences: torch.Tensor, scores: torch.Tensor, penalty: float,
                       prompt_padding: torch.Tensor | None = None) -> torch.Tensor:
    """CTRL's penalty: a seen token's logit is divided by `penalty` if positive, multiplied if negative.

    As in transformers, the first prompt_padding[b] positions of row b (its left padding) are not seen."""
    vocab = scores.shape[-1]
    if prompt_padding is not None:
        positions = torch.arange(sequences.shape[1], device=sequences.device)
        sequences = sequences.masked_fill(positions < prompt_padding[:, None], vocab)
    padded = torch.nn.functional.pad(scores, (0, 1))  # column `vocab` absorbs the skipped positions
    sequences = sequences.clamp(max=vocab)
    seen = torch.gather(padded, 1, sequences)
    seen = torch.where(seen < 0, seen * penalty, seen / penalty)
    return padded.scatter(1, sequences, seen)[:, :vocab]


def no_repeat_ngram(sequences: torch.Tensor, scores: torch.Tensor, n: int) -> torch.Tensor:
    """Forbid any token that would complete an n-gram already present in the row."""
    length = sequences.shape[1]
    if length + 1 < n:
        return scores
    scores = scores.clone()
    for row, seq in enumerate(sequences.tolist()):
        prefix = tuple(seq[length - n + 1:])
        banned = [seq[i + n - 1] for i in range(length - n + 1) if tuple(seq[i:i + n - 1]) == prefix]
        if banned:
            scores[row, banned] = NEG_INF
    return scores


def top_k_filter(scores: torch.Tensor, k: int, keep: int = 1) -> torch.Tensor:
    """Keep the max(k, keep) largest logits of each row (ties at the last value kept), -inf elsewhere."""
    k = min(max(k, keep, 1), scores.shape[-1])
    threshold = torch.topk(scores, k)[0][..., -1, None]
    return scores.masked_fill(scores < threshold, NEG_INF)


def top_p_filter(scores: torch.Tensor, p: float, keep: int = 1) -> torch.Tensor:
    """Keep the smallest set of most likely tokens whose probability reaches p (at least `keep`)."""
    sorted_logits, sorted_indices = torch.sort(scores, descending=False)
    cumulative = sorted_logits.softmax(dim=-1).cumsum(dim=-1)
    remove_sorted = cumulative <= (1 - p)
    remove_sorted[..., -keep:] = False
    remove = remove_sorted.scatter(1, sorted_indices, remove_sorted)
    return scores.masked_fill(remove, NEG_INF)


def min_p_filter(scores: torch.Tensor, min_p: float, keep: int = 1) -> torch.Tensor:
    """Drop tokens whose probability is below min_p times the top token's (the `keep` likeliest stay)."""
    probs = scores.softmax(dim=-1)
    remove = probs < min_p * probs.amax(dim=-1, keepdim=True)
    remove.scatter_(-1, torch.topk(probs, min(keep, probs.shape[-1]), dim=-1).indices, False)
    return scores.masked_fill(remove, NEG_INF)


def typical_filter(scores: torch.Tensor, mass: float, keep: int = 1) -> torch.Tensor:
    """Locally typical sampling: rank tokens by |-log p - H| and keep the closest ones until their mass
    reaches `mass` (at least `keep`)."""
    log_p = torch.nn.functional.log_softmax(scores, dim=-1)
    entropy = -(log_p * log_p.exp()).nansum(-1, keepdim=True)  # 0 * -inf of banned tokens counts as 0
    distance, order = torch.sort((-log_p - entropy).abs(), descending=False)
    cumulative = scores.gather(-1, order).softmax(dim=-1).cumsum(dim=-1)
    last = (cumulative < mass).sum(dim=1).clamp_(max=distance.shape[-1] - 1)
    remove_sorted = distance > distance.gather(1, last.view(-1, 1))
    remove_sorted[..., :keep] = False
    return scores.masked_fill(remove_sorted.scatter(1, order, remove_sorted), NEG_INF)


def _below(scores: torch.Tensor, cutoff: torch.Tensor | float, keep: int) -> torch.Tensor:
    """Tokens of probability under `cutoff`, sparing the `keep` highest logits."""
    kth = torch.topk(scores, min(keep, scores.shape[-1]))[0][..., -1, None]
    return (scores.softmax(dim=-1) < cutoff) & (scores < kth)


def epsilon_filter(scores: torch.Tensor, epsilon: float, keep: int = 1) -> torch.Tensor:
    """Epsilon sampling: drop tokens of probability below epsilon."""
    return scores.masked_fill(_below(scores, epsilon, keep), NEG_INF)


def eta_filter(scores: torch.Tensor, epsilon: float, keep: int = 1) -> torch.Tensor:
    """Eta sampling: drop tokens of probability below min(epsilon, sqrt(epsilon) exp(-H))."""
    eps = torch.tensor(epsilon, device=scores.device)  # float32, as transformers computes the cutoff
    entropy = torch.distributions.Categorical(logits=scores).entropy()
    eta = torch.min(eps, eps.sqrt() * torch.exp(-entropy))[..., None]
    return scores.masked_fill(_below(scores, eta, keep), NEG_INF)


def suppress(scores: torch.Tensor, tokens: torch.Tensor) -> torch.Tensor:
    """Set the logits of `tokens` to -inf (ids outside the vocabulary are ignored, as in transformers)."""
    banned = torch.isin(torch.arange(scores.shape[-1], device=scores.device), tokens.to(scores.device))
    return torch.where(banned, NEG_INF, scores)


# generation_config.json settings that change transformers' ids but that lmkit does not implement: name -> the
# values that leave decoding as it is (any other value is refused rather than silently ignored)
UNSUPPORTED_SETTINGS = {"encoder_repetition_penalty": (None, 1.0), "exponential_decay_length_penalty": (None,),
                        "num_beam_groups": (None, 1), "penalty_alpha": (None, 0.0), "guidance_scale": (None, 1.0),
                        "top_h": (None,), "renormalize_logits": (None, False), "constraints": (None,),
                        "force_words_ids": (None,), "dola_layers": (None,), "watermarking_config": (None,)}


def check_supported(defaults: dict) -> None:
    """Refuse a generation_config.json that asks for a decoding lmkit does not implement."""
    for name, neutral in UNSUPPORTED_SETTINGS.items():
        if defaults.get(name) not in neutral:
            raise GenerationError(f"generation_config.json sets {name}={defaults[name]!r}, which lmkit's generate does "
                                  f"not implement; delete it from model.generation_defaults (or the file) to decode "
                                  f"without it")


def force_tokens(scores: torch.Tensor, tokens: list[int]) -> torch.Tensor:
    """transformers' forced BOS / EOS at their step: the forced `tokens` score 0, all others -inf."""
    scores = torch.full_like(scores, NEG_INF)
    scores[:, list(tokens)] = 0
    return scores


def id_list(value) -> list[int]:
    """A token id setting (None, one id or a list of them) as a list."""
    if value is None:
        return []
    return [int(v) for v in value] if isinstance(value, (list, tuple)) else [int(value)]


def count_penalties(scores: torch.Tensor, output: list[int], presence: float, frequency: float) -> torch.Tensor:
    """OpenAI's presence and frequency penalties: logit_t - presence * [c_t > 0] - frequency * c_t, where c_t counts
    token t in the output so far (the prompt not included)."""
    if not output or (presence == 0 and frequency == 0):
        return scores
    counts = torch.bincount(torch.tensor(output, device=scores.device), minlength=scores.shape[-1])[:scores.shape[-1]]
    return scores - presence * (counts > 0).to(scores.dtype) - frequency * counts.to(scores.dtype)
