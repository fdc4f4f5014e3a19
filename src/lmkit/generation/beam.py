"""Beam search for every family, with transformers' exact semantics (its vectorised `_beam_search`).

Each step scores every continuation of every running beam by its summed log-probability and keeps
the K = max(2, 1 + n_eos) * num_beams best. Of those, candidates that end in EOS (or reach max
length) and rank among the first num_beams become finished hypotheses scored by
sum log p / (generated length) ** length_penalty; the best num_beams unfinished ones run on.
early_stopping: True stops a row once num_beams hypotheses are finished; False stops when the best
running beam, normalised by the current length, can no longer beat the worst finished one;
"never" estimates that bound at max length when length_penalty > 0.
Shorter finished hypotheses are padded with pad_token_id (eos when pad is 0 or unset).
"""
from __future__ import annotations

import torch
import torch.nn.functional as F

from lmkit.generation.step import Decoding

_NEG = -1.0e9


def _gather(tensor: torch.Tensor, index: torch.Tensor) -> torch.Tensor:
    """tensor (B, n, ...) -> (B, m, ...) picking index (B, m) along dim 1."""
    while index.dim() < tensor.dim():
        index = index.unsqueeze(-1)
    return torch.take_along_dim(tensor, index, dim=1)


def beam_search(model, input_ids: torch.Tensor, decoding: Decoding, **model_kwargs) -> torch.Tensor:
    """The n = num_return_sequences best hypotheses per row, best first (B * n, prompt + generated); the model is
    called through its `DecodingInterface`, the scores through the decoding's processors (`beam_steps`)."""
    start, state = model.prepare_generation(input_ids, decoding.attention_mask, **model_kwargs)
    steps = beam_steps(start, decoding)
    parents, tokens = next(steps)
    while True:
        model.reorder_generation(state, parents)
        try:
            parents, tokens = steps.send(model.generation_logits(state, tokens))
        except StopIteration as done:
            finals, lengths = done.value
            n = decoding.config.num_return_sequences
            length = start.shape[1] + int(lengths[:, :n].max())
            return finals[:, :n, :length].reshape(start.shape[0] * n, length)


def beam_steps(start: torch.Tensor, decoding: Decoding):
    """Beam search over the rows of `start` (B, S), the sequences the output starts from, as a generator that never
    calls a model: it yields (parents (B * k), tokens (B * k, t)), the rows each beam's keys and values come from
    and the tokens it feeds next, and is sent the logits (B * k, V) after them; it returns the finished hypotheses
    (B, k, max length, best first) and their generated lengths (B, k). The first yield feeds every beam the whole
    of `start`. `generate` and the serving engine both drive it."""
    cfg, eos = decoding.config, decoding.eos
    num_beams, length_penalty, early_stopping = cfg.num_beams, cfg.length_penalty, cfg.early_stopping
    pad_token_id = decoding.pad_token_id
    B, prompt_len = start.shape
    k, device = num_beams, start.device
    beams = torch.arange(B, device=device).repeat_interleave(k)
    processors = decoding.processors.select(beams)  # one row per beam
    max_length = prompt_len + decoding.max_new_tokens
    fill = (pad_token_id if pad_token_id else eos[0]) if eos else -1
    keep = max(2, 1 + len(eos)) * k
    top_k_mask = torch.arange(keep, device=device) < k
    eos_t = torch.tensor(eos, device=device) if eos else None

    running = torch.full((B, k, max_length), fill, dtype=torch.long, device=device)
    running[:, :, :prompt_len] = start[:, None]
    finals = running.clone()
    running_scores = torch.zeros(B, k, device=device)
    running_scores[:, 1:] = _NEG  # only the first beam's continuations count at the first step
    running_lengths = torch.zeros(B, k, dtype=torch.long, device=device)
    final_scores = torch.full((B, k), _NEG, device=device)
    final_lengths = torch.zeros(B, k, dtype=torch.long, device=device)
    finished = torch.zeros(B, k, dtype=torch.bool, device=device)
    improvable = torch.ones(B, 1, dtype=torch.bool, device=device)
    offsets = torch.arange(B, device=device)[:, None] * k
    parents, tokens, cur_len = beams, start.repeat_interleave(k, dim=0), prompt_len

    while True:
        logits = yield parents, tokens
        log_probs = F.log_softmax(logits.float(), dim=-1)
        log_probs = processors(running[:, :, :cur_len].reshape(B * k, cur_len), log_probs)
        V = log_probs.shape[-1]
        total = (log_probs.view(B, k, V) + running_scores[:, :, None]).view(B, k * V)

        # the K best continuations over all beams (or K sampled without replacement)
        if cfg.do_sample:
            index = torch.multinomial(total.softmax(-1), num_samples=keep)
            cand_scores, order = torch.gather(total, 1, index).sort(dim=-1, descending=True)
            index = index.gather(-1, order)
        else:
            cand_scores, index = torch.topk(total, k=keep)
        parent = index // V
        cand = _gather(running, parent)
        cand[:, :, cur_len] = index % V
        cand_lengths = _gather(running_lengths, parent) + 1
        if cur_len + 1 >= max_length:
            hits = torch.ones_like(parent, dtype=torch.bool)
        elif eos_t is not None:
            hits = torch.isin(cand[:, :, cur_len], eos_t)
        else:
            hits = torch.zeros_like(parent, dtype=torch.bool)

        # the best num_beams unfinished candidates run on
        run_scores = cand_scores + hits.float() * _NEG
        best = torch.topk(run_scores, k=k)[1]
        running, running_scores = _gather(cand, best), _gather(run_scores, best)
        running_lengths, parents = _gather(cand_lengths, best), _gather(parent + offsets, best)

        # finished candidates among the first num_beams replace worse finished hypotheses
        just_finished = hits & top_k_mask[None, :]
        scores = cand_scores / ((cur_len + 1 - prompt_len) ** length_penalty)
        scores += (finished.all(-1, keepdim=True) & (early_stopping is True)).float() * _NEG
        scores += (~improvable).float() * _NEG
        scores += (~just_finished) * _NEG
        merged = torch.cat((final_scores, scores), dim=1)
        best = torch.topk(merged, k=k)[1]
        finals = _gather(torch.cat((finals, cand), dim=1), best)
        final_scores = _gather(merged, best)
        final_lengths = _gather(torch.cat((final_lengths, cand_lengths), dim=1), best)
        finished = _gather(torch.cat((finished, just_finished), dim=1), best)

        parents = parents.reshape(-1)
        tokens = running[:, :, cur_len].reshape(B * k, 1)
        cur_len += 1

        # can a running beam still beat the worst finished hypothesis?
        if early_stopping == "never" and length_penalty > 0.0:
            best_length = max_length - prompt_len
        else:
            best_length = cur_len - prompt_len
        best_running = running_scores[:, :1] / (best_length ** length_penalty)
        worst_final = torch.where(finished, final_scores.min(dim=1, keepdim=True)[0], _NEG)
        improvable = improvable & (best_running > worst_final).any(dim=-1, keepdim=True)
        all_full = bool(finished.all()) and early_stopping is True
        if not bool(improvable.any()) or all_full or bool(hits.all()):
            break

    return finals, final_lengths
