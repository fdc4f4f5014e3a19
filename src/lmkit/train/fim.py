"""`--objective fim`: causal-LM training where each document piece of a row becomes, with probability
--fim-rate, a fill-in-the-middle example (SPM with probability --fim-spm-rate, else PSM; the layouts in
lmkit.data.fim). The rows keep their length, the loss is next-token prediction over every token but the
padding (`<|pad|>` and `<fim_pad>`), and validation is plain left-to-right: the same bits per byte as a clm
run, which is what "FIM for free" compares. `prepare` adds the sentinels to the tokenizer (and so to the
embeddings, which are sized from it).
"""
from __future__ import annotations

from typing import Any

import torch

from lmkit.data.fim import FimIds, add_sentinels, fim_piece, split_points
from lmkit.errors import TrainingError
from lmkit.objectives import next_token_targets
from lmkit.train.objective import CLM, Objective, clm_loss


class FillInTheMiddle:
    """Batch builder of FIM training for one tokenizer: rows BOS p_1 BOS p_2 ... with each piece p_i rewritten."""

    def __init__(self, tok: Any, ids: FimIds, rate: float, spm_rate: float):
        self.tok, self.ids, self.rate, self.spm_rate = tok, ids, rate, spm_rate

    def row(self, tokens: list[int], bos: int, pad_id: int, generator: torch.Generator | None) -> list[int]:
        """One row with each BOS-led piece rewritten or kept; the draws, in order: rate, then cut and order."""
        def draw(n: int) -> int:
            return int(torch.randint(n, (1,), generator=generator))

        def coin(p: float) -> bool:
            return bool(torch.rand((), generator=generator) < p)

        out: list[int] = []
        starts = [i for i, t in enumerate(tokens) if t == bos] + [len(tokens)]
        out.extend(tokens[:starts[0]])
        for a, b in zip(starts, starts[1:]):
            piece = tokens[a + 1:b]
            body = [t for t in piece if t != pad_id]
            if body and len(body) == len(piece) and coin(self.rate):
                cut = split_points(len(self.tok.decode(body)), draw)
                piece = fim_piece(body, self.tok, self.ids, cut, coin(self.spm_rate))
            out.extend([tokens[a]] + piece)
        return out

    def build_batch(self, rows: torch.Tensor, pad_id: int, generator: torch.Generator | None = None) -> dict:
        bos = int(rows[0, 0])
        new = torch.tensor([self.row(r, bos, pad_id, generator) for r in rows.tolist()], dtype=rows.dtype)
        new = new.to(rows.device)
        mask = ((new != pad_id) & (new != self.ids.pad)).long()
        inputs, labels = next_token_targets(new, mask)
        return {"input_ids": inputs, "labels": labels}


class FimObjective(Objective):
    """The registered `fim` objective; `configured(cfg)` takes the rates, `prepare(tokenizer)` adds the sentinels."""

    rate, spm_rate = 0.5, 0.5

    def configured(self, cfg: Any) -> "FimObjective":
        for name in ("fim_rate", "fim_spm_rate"):
            value = getattr(cfg, name)
            if not 0.0 <= value <= 1.0:
                raise TrainingError(f"--{name.replace('_', '-')} must be between 0 and 1, got {value}")
        objective = FimObjective(self.name, self.architecture, self.build_batch, self.loss, self.evaluate)
        objective.rate, objective.spm_rate = cfg.fim_rate, cfg.fim_spm_rate
        return objective

    def prepare(self, tokenizer: Any) -> Objective:
        task = FillInTheMiddle(tokenizer, add_sentinels(tokenizer), self.rate, self.spm_rate)
        return Objective(self.name, self.architecture, task.build_batch, clm_loss, CLM.evaluate)


FIM = FimObjective("fim", "decoder", CLM.build_batch, clm_loss, CLM.evaluate)
