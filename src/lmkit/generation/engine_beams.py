"""Beam search in the serving engine: a request with num_beams = k decodes as k rows of the running batch, driven by
generate's own beam search (`beam.beam_steps`), so that its hypotheses are generate's.

The request and k - 1 rows the engine makes for it form a `Group` (`beam_group`) that joins the batch together;
the request prefills the prompt once and the rows copy its keys and values. After each step the k rows' logits go
to `beam_steps`, which answers with each beam's parent row and next token: the rows' slots are reordered by copying
their keys and values from their parents' slots (`SlotCache.reorder`; an encoder-decoder's cross-attention keys
and values are the same for every row of one source and stay). When the search ends, the request's `beams` are
the num_return_sequences best hypotheses (best first, as generate returns them) and its `output` the best one.
A beam request has no streaming, log-probabilities, stop strings or sampling (beam sampling draws from torch's
global generator in generate); those stay on `generate`.
"""
from __future__ import annotations

import torch

from lmkit.errors import GenerationError
from lmkit.generation.beam import beam_steps
from lmkit.generation.requests import Group, Request


def beam_group(request: Request, slots: int) -> Group:
    """The group of k rows that decodes `request` (prepared, num_beams = k > 1) by beam search."""
    cfg = request.decoding.config
    if cfg.do_sample or request.logprobs is not None or request.prompt_logprobs is not None or request.score_only \
            or request.decoding.stops or request.processors or request.presence_penalty or request.frequency_penalty:
        raise GenerationError("the engine's beam search is generate's deterministic one: leave out sampling, "
                              "logprobs, stop strings, structured outputs and penalties with num_beams > 1 (or "
                              "call generate)")
    if cfg.num_beams > slots:
        raise GenerationError(f"num_beams = {cfg.num_beams} rows decode together, more than the engine's {slots} "
                              f"slots; lower num_beams (or raise --max-concurrency)")
    rows = [Request(prompt=request.prompt, config=request.config, adapter=request.adapter)
            for _ in range(cfg.num_beams - 1)]
    for row in rows:
        row.decoding = request.decoding
    group = Group([request, *rows])
    group.search = BeamRun(group)
    for member in group.members:
        member.group = group
    return group


class BeamRun:
    """One beam search over a group's rows: `step` feeds it the rows' logits and applies its answer."""

    def __init__(self, group: Group):
        self.group = group
        self.steps = None  # beam_steps, started at the first step (an encoder-decoder's start is known only then)

    def step(self, engine, rows: dict[int, torch.Tensor]) -> None:
        """Advance the search by the rows' logits (id(row) -> (1, V)): reorder the rows' slots and give each its
        next token, or end the request with its hypotheses."""
        members, leader = self.group.members, self.group.members[0]
        logits = torch.cat([rows[id(m)] for m in members])
        if self.steps is None:
            self.start = len(leader.history)
            self.steps = beam_steps(torch.tensor([leader.history], device=logits.device), leader.decoding)
            next(self.steps)  # every row already holds the prompt
        try:
            parents, tokens = self.steps.send(logits)
        except StopIteration as done:
            finals, lengths = done.value
            leader.beams = [finals[0, i, self.start:self.start + int(lengths[0, i])].tolist()
                            for i in range(leader.decoding.config.num_return_sequences)]
            reason = "stop" if leader.beams[0] and leader.beams[0][-1] in leader.decoding.eos else "length"
            leader.output = list(leader.beams[0])
            for member in members:
                engine._finish(member, reason)
            return
        parents = parents.tolist()
        slots = [m.slot for m in members]
        engine.cache.reorder(slots, [slots[p] for p in parents])
        outputs = [members[p].output for p in parents]
        for member, output, token in zip(members, outputs, tokens[:, -1].tolist()):
            member.output = output + [token]
