"""`--objective span` (T5 span corruption) and `--objective denoise` (BART's noisings, `--noise`, train/noise.py;
default text infilling and sentence permutation): the packed rows of the corpus become (corrupted source, original or spans) pairs.

Each step corrupts its rows afresh with the step's seeded generator (repeatable per seed and step);
the encoder reads the corrupted row, the decoder is teacher-forced on the target, which ends with
EOS. The loss is summed over target tokens and divided by their count. Validation uses one fixed
corruption of the held-out rows. The run's tokenizer gets the sentinel / mask tokens (`prepare`).
"""
from __future__ import annotations

from typing import Any

import torch

from lmkit.errors import ConfigError
from lmkit.objectives import LossSum, next_token_loss, noise_span_counts, seq2seq_batch, span_corruption
from lmkit.train.noise import noiser
from lmkit.train.objective import FixedCorruptionEvaluation, Objective

SENTINELS = [f"<extra_id_{i}>" for i in range(100)]
MASK = "<mask>"


class Denoising(FixedCorruptionEvaluation):
    """Batch builder, loss and evaluation of one encoder-decoder denoising objective for one tokenizer."""

    eval_seed = 4321

    def __init__(self, kind: str, special_ids: list[int], end_ids: set[int], noise: str | None = None):
        self.kind, self.special_ids, self.end_ids = kind, special_ids, end_ids
        self.noise = noiser(noise, special_ids[0], end_ids) if kind == "denoise" else None

    def corrupt(self, tokens: list[int], eos: int, generator: torch.Generator) -> tuple[list[int], list[int]]:
        if self.kind == "span":
            return span_corruption(tokens, self.special_ids, generator=generator, eos_id=eos)
        return self.noise(list(tokens), generator) + [eos], list(tokens)

    def build_batch(self, rows: torch.Tensor, pad_id: int, generator: torch.Generator | None = None) -> dict:
        """Rows BOS x_1..x_T (padded) -> corrupted sources and targets; BOS doubles as EOS, as in the trainer."""
        sources, targets = [], []
        for row in rows.tolist():
            eos = row[0]
            tokens = [t for t in row[1:] if t != pad_id]
            s, t = self.corrupt(tokens, eos, generator)
            sources.append(s)
            targets.append(t)
        batch = seq2seq_batch(sources, targets, pad_id, eos_id=int(rows[0, 0]))
        return {k: v.to(rows.device) for k, v in batch.items()}

    def loss(self, model: torch.nn.Module, batch: dict) -> tuple[LossSum, torch.Tensor | None]:
        out = model(batch["input_ids"], attention_mask=batch["attention_mask"], labels=batch["labels"])
        return next_token_loss(out.logits, batch["labels"]), getattr(out, "aux_loss", None)


class DenoisingObjective(Objective):
    """The registered objective; `prepare(tokenizer)` adds its special tokens and returns the one to train with."""

    def prepare(self, tokenizer: Any, noise: str | None = None) -> Objective:
        """noise: denoise's `--noise` (None: infilling,permutation)."""
        if noise is not None and self.name != "denoise":
            raise ConfigError(f"--noise chooses BART's noisings of --objective denoise, not of --objective {self.name}")
        names = SENTINELS if self.name == "span" else [MASK]
        missing = [n for n in names if tokenizer.token_to_id(n) is None]
        if missing:
            # T5 numbers sentinels down from the top of the vocabulary: <extra_id_0> = V - 1, <extra_id_1> = V - 2, ...
            tokenizer.add_special_tokens(missing[::-1])
        ids = [int(tokenizer.token_to_id(n)) for n in names]
        # sentence ends: tokens that end in a full stop (byte-level BPE writes a newline as "Ċ")
        ends = {i for t, i in tokenizer.get_vocab().items() if t.rstrip("Ċ\n").endswith((".", "!", "?"))}
        task = Denoising(self.name, ids, ends, noise)
        return Objective(self.name, self.architecture, task.build_batch, task.loss, task.evaluate)


def _unprepared(*_: Any, **__: Any):
    raise RuntimeError("a denoising objective needs prepare(tokenizer) before use")


SPAN = DenoisingObjective("span", "encoder-decoder", _unprepared, _unprepared, _unprepared)
DENOISE = DenoisingObjective("denoise", "encoder-decoder", _unprepared, _unprepared, _unprepared)


def seq2seq_run_settings(base: Any, objective: str, eos_id: int, pad_id: int, seq_len: int) -> dict[str, int]:
    """Config fields of an encoder-decoder trained on rows of seq_len tokens with the run's tokenizer.

    The denoise target is the whole row plus EOS (seq_len + 1 tokens), so learned position tables
    (BART) need seq_len + 1 rows. The preset's decoder start token keeps its role in the new
    vocabulary: pad for T5 (and when unset), EOS for BART.
    """
    if objective == "span" and noise_span_counts(seq_len)[1] > len(SENTINELS):  # one sentinel per span
        fits = max(n for n in range(2, seq_len) if noise_span_counts(n)[1] <= len(SENTINELS))
        raise ConfigError(f"--seq-len {seq_len} gives {noise_span_counts(seq_len)[1]} noise spans per row, more than "
                          f"the {len(SENTINELS)} sentinel tokens; use --seq-len {fits} or less")
    start = base.decoder_start_token_id
    is_eos = start is not None and start == base.eos_token_id and start != base.pad_token_id
    return {"max_seq_len": seq_len + 1, "decoder_start_token_id": eos_id if is_eos else pad_id}
