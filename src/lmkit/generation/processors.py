"""Logits processors: transformers' `LogitsProcessorList` pattern. Each processor is a class whose
`__call__(input_ids (B, T), scores (B, V) float32)` returns new scores; `build_processors` makes the list once
from a resolved `GenerationConfig`, in transformers' order (its `_get_logits_processor`): sequence bias,
repetition penalty, n-gram blocking (the output's, then the prompt's), bad words, the minimum-length EOS ban,
forced BOS/EOS, suppressed tokens; then, for sampling, temperature, top-k, top-p, min-p, typical, epsilon and
eta truncation. A new decoding option is one class here and one `GenerationConfig` field.

A processor also says when it acts (`acts_at(length)`: after how many tokens it may change a score, so greedy
decoding skips the list at steps nothing changes), whether it reads the sequences at all (`reads_ids`: the engine
need not build them for a group that only samples) and how it follows a change of rows (`select(index)`: the
batch's rows repeated for samples or beams, or one row alone), for processors that hold per-row state.
"""
from __future__ import annotations

import torch

from lmkit.errors import GenerationError
from lmkit.generation.logits import (count_penalties, epsilon_filter, eta_filter, force_tokens, id_list, min_p_filter,
                                     no_repeat_ngram, repetition_penalty, suppress, top_k_filter, top_p_filter,
                                     typical_filter)

NEG_INF = -float("inf")


class LogitsProcessor:
    """One change of the next-token scores (see the module docstring)."""

    reads_ids = True  # False: it reads the scores only, and may be called with input_ids None

    def __call__(self, input_ids: torch.Tensor, scores: torch.Tensor) -> torch.Tensor:
        raise NotImplementedError

    def acts_at(self, length: int) -> bool:
        """Whether it may change a score after sequences of `length` tokens."""
        return True

    def select(self, index: torch.Tensor) -> "LogitsProcessor":
        """This processor for the rows `index` of the batch it was built for."""
        return self


class LogitsProcessorList(list):
    """Processors applied in order; the ones that do not act at the sequences' length are skipped."""

    def __call__(self, input_ids: torch.Tensor, scores: torch.Tensor) -> torch.Tensor:
        length = input_ids.shape[1]
        for processor in self:
            if processor.acts_at(length):
                scores = processor(input_ids, scores)
        return scores

    def acts_at(self, length: int) -> bool:
        return any(p.acts_at(length) for p in self)

    def select(self, index: torch.Tensor) -> "LogitsProcessorList":
        return LogitsProcessorList(p.select(index) for p in self)


class SequenceBias(LogitsProcessor):
    """Add bias[s] to the logit of token s[-1] in every row that ends with s[:-1] (a one-token s: always).

    transformers' SequenceBiasLogitsProcessor; bad words are the biases -inf. `table` maps token tuples to biases.
    """

    def __init__(self, table: dict[tuple[int, ...], float], vocab_size: int):
        self.single = torch.zeros(vocab_size)
        for seq, bias in table.items():
            if len(seq) == 1:
                self.single[seq[0]] = bias
        groups: dict[int, list] = {}  # prefix length -> [(sequence, bias)], matched together
        for seq, bias in table.items():
            if len(seq) > 1:
                groups.setdefault(len(seq) - 1, []).append((seq, bias))
        self.groups = [(torch.tensor([s[:-1] for s, _ in g]), torch.tensor([s[-1] for s, _ in g]),
                        torch.tensor([b for _, b in g], dtype=torch.float)) for g in groups.values()]

    def __call__(self, input_ids: torch.Tensor, scores: torch.Tensor) -> torch.Tensor:
        bias = torch.zeros_like(scores)
        bias += self.single.to(scores.device)
        for prefixes, last, biases in self.groups:
            if prefixes.shape[1] > input_ids.shape[1]:
                continue
            prefixes, last, biases = prefixes.to(scores.device), last.to(scores.device), biases.to(scores.device)
            match = (input_ids[:, None, -prefixes.shape[1]:] == prefixes).all(dim=-1)
            bias.index_add_(1, last, torch.where(match, biases, 0.0).to(bias.dtype))
        return scores + bias


class RepetitionPenalty(LogitsProcessor):
    """CTRL's penalty over each row's tokens (`logits.repetition_penalty`), its left padding (`padding[b]`
    columns of row b) left out as transformers leaves it out."""

    def __init__(self, penalty: float, padding: torch.Tensor | None = None):
        self.penalty, self.padding = penalty, padding

    def __call__(self, input_ids, scores):
        return repetition_penalty(input_ids, scores, self.penalty, self.padding)

    def select(self, index):
        return self if self.padding is None else RepetitionPenalty(self.penalty, self.padding[index])


class NoRepeatNGram(LogitsProcessor):
    """Forbid any token that would complete an n-gram already present in the row."""

    def __init__(self, n: int):
        self.n = n

    def __call__(self, input_ids, scores):
        return no_repeat_ngram(input_ids, scores, self.n)

    def acts_at(self, length):
        return length + 1 >= self.n


class EncoderNoRepeatNGram(LogitsProcessor):
    """Forbid any token that would complete an n-gram of the row's prompt (the encoder's input ids, padding
    included), however many times the output already holds it: transformers' EncoderNoRepeatNGramLogitsProcessor."""

    def __init__(self, prompts: torch.Tensor | None, n: int, tables: list | None = None):
        self.n, self.tables = n, tables if tables is not None else []
        for row in ([] if prompts is None else prompts.tolist()):
            table: dict[tuple[int, ...], list[int]] = {}
            for i in range(len(row) - n + 1):
                table.setdefault(tuple(row[i:i + n - 1]), []).append(row[i + n - 1])
            self.tables.append(table)

    def __call__(self, input_ids, scores):
        scores = scores.clone()
        for row, prefix in enumerate(input_ids[:, input_ids.shape[1] - self.n + 1:].tolist()):
            banned = self.tables[row].get(tuple(prefix))
            if banned:
                scores[row, banned] = NEG_INF
        return scores

    def acts_at(self, length):
        return length + 1 >= self.n

    def select(self, index):
        return EncoderNoRepeatNGram(None, self.n, [self.tables[i] for i in index.tolist()])


class MinNewTokens(LogitsProcessor):
    """No EOS id before `until` tokens (min_new_tokens after the start); ids past the vocabulary, which can never be
    generated, are skipped as transformers' MinNewTokensLengthLogitsProcessor skips them."""

    def __init__(self, eos: list[int], until: int):
        self.eos, self.until = eos, until

    def __call__(self, input_ids, scores):
        inside = [e for e in self.eos if 0 <= e < scores.shape[-1]]
        if inside:
            scores = scores.clone()
            scores[:, inside] = NEG_INF
        return scores

    def acts_at(self, length):
        return length < self.until and bool(self.eos)


class ForcedBOS(LogitsProcessor):
    """After a one-token sequence only `bos` may come (score 0, all others -inf)."""

    def __init__(self, bos: int):
        self.bos = bos

    def __call__(self, input_ids, scores):
        return force_tokens(scores, [self.bos])

    def acts_at(self, length):
        return length == 1


class ForcedEOS(LogitsProcessor):
    """The token that reaches `max_length` must be one of `eos` (score 0, all others -inf)."""

    def __init__(self, eos: list[int], max_length: int):
        self.eos, self.max_length = eos, max_length

    def __call__(self, input_ids, scores):
        return force_tokens(scores, self.eos)

    def acts_at(self, length):
        return length == self.max_length - 1


class SuppressTokens(LogitsProcessor):
    """The logits of `tokens` set to -inf (ids outside the vocabulary ignored); only at sequences of length
    `at`, when given (begin_suppress_tokens)."""

    def __init__(self, tokens: list[int], at: int | None = None):
        self.tokens, self.at = torch.tensor(tokens, dtype=torch.long), at

    def __call__(self, input_ids, scores):
        return suppress(scores, self.tokens)

    def acts_at(self, length):
        return self.at is None or length == self.at


class Temperature(LogitsProcessor):
    reads_ids = False

    def __init__(self, temperature: float):
        self.temperature = temperature

    def __call__(self, input_ids, scores):
        return scores / self.temperature


class Truncation(LogitsProcessor):
    """One of logits.py's sampling filters with its parameter, keeping at least `keep` tokens."""

    reads_ids = False

    def __init__(self, filter_fn, value, keep: int = 1):
        self.filter_fn, self.value, self.keep = filter_fn, value, keep

    def __call__(self, input_ids, scores):
        return self.filter_fn(scores, self.value, self.keep)


class CountPenalties(LogitsProcessor):
    """OpenAI's presence and frequency penalties over the tokens after the first `start` (`logits.count_penalties`)."""

    def __init__(self, start: int, presence: float, frequency: float):
        self.start, self.presence, self.frequency = start, presence, frequency

    def __call__(self, input_ids, scores):
        return torch.cat([count_penalties(scores[r:r + 1], row[self.start:], self.presence, self.frequency)
                          for r, row in enumerate(input_ids.tolist())])


def _token_lists(value, name: str, vocab_size: int) -> list[tuple[int, ...]]:
    if not isinstance(value, (list, tuple)) or not value or any(
            not isinstance(seq, (list, tuple)) or not seq or any(isinstance(t, bool) or not isinstance(t, int)
                                                                  or not 0 <= t < vocab_size for t in seq)
            for seq in value):
        raise GenerationError(f"{name} must be a non-empty list of non-empty lists of token ids below the vocabulary "
                              f"size {vocab_size}, e.g. [[12, 7], [40]]; got {value!r}")
    return [tuple(seq) for seq in value]


def sequence_bias_table(value, vocab_size: int) -> SequenceBias:
    """generate's sequence_bias, [[ids, bias], ...] or {tuple(ids): bias} (a later duplicate wins, as in
    transformers)."""
    pairs = list(value.items()) if isinstance(value, dict) else value
    if not isinstance(pairs, (list, tuple)) or not pairs or any(
            not isinstance(p, (list, tuple)) or len(p) != 2 or isinstance(p[1], bool)
            or not isinstance(p[1], (int, float)) for p in pairs):
        raise GenerationError(f"sequence_bias must be a non-empty list of [token ids, bias] pairs, e.g. "
                              f"[[[12, 7], -2.0], [[40], 1.5]]; got {value!r}")
    seqs = _token_lists([p[0] for p in pairs], "sequence_bias's token lists", vocab_size)
    return SequenceBias({seq: float(p[1]) for seq, p in zip(seqs, pairs)}, vocab_size)


def bad_words_table(value, eos: list[int], vocab_size: int) -> SequenceBias | None:
    """generate's bad_words_ids as biases of -inf; a lone EOS among them is not banned, as in transformers."""
    seqs = [s for s in _token_lists(value, "bad_words_ids", vocab_size) if not (len(s) == 1 and s[0] in eos)]
    return SequenceBias({s: NEG_INF for s in seqs}, vocab_size) if seqs else None


def _check(cfg) -> None:
    """Refuse the processor settings transformers' processors refuse."""
    for name, low_open, high_open in (("min_p", False, False), ("typical_p", True, False),
                                      ("epsilon_cutoff", False, True), ("eta_cutoff", False, True)):
        value = getattr(cfg, name)
        if value is not None and (isinstance(value, bool) or not isinstance(value, (int, float))
                                  or value < 0 or value > 1 or (low_open and value == 0) or (high_open and value == 1)):
            bounds = ("(" if low_open else "[") + "0, 1" + (")" if high_open else "]")
            raise GenerationError(f"{name} must be a number in {bounds}, got {value!r}")
    for name in ("suppress_tokens", "begin_suppress_tokens"):
        value = getattr(cfg, name)
        if value is not None and (not isinstance(value, (list, tuple))
                                  or any(isinstance(t, bool) or not isinstance(t, int) for t in value)):
            raise GenerationError(f"{name} must be a list of token ids, got {value!r}")
    for name, tokens in (("forced_bos_token_id", [] if cfg.forced_bos_token_id is None else [cfg.forced_bos_token_id]),
                         ("forced_eos_token_id", id_list(cfg.forced_eos_token_id))):
        if tokens and cfg.suppress_tokens is not None and set(tokens) <= set(cfg.suppress_tokens):
            raise GenerationError(f"every token of {name} ({sorted(set(tokens))}) is also in suppress_tokens, which "
                                  f"leaves no token at the forced step; remove it from one of them")
    for name in ("no_repeat_ngram_size", "encoder_no_repeat_ngram_size"):
        n = getattr(cfg, name)
        if isinstance(n, bool) or not isinstance(n, int) or n < 0:
            raise GenerationError(f"{name} must be an int >= 0 (0 turns it off), got {n!r}")


def build_processors(cfg, vocab_size: int, eos: list[int], *, start: int, max_length: int, min_new_tokens: int,
                     prompts: torch.Tensor, prompt_padding: torch.Tensor | None = None,
                     keep: int = 1) -> LogitsProcessorList:
    """The processors a resolved config asks for, in transformers' order (see the module docstring).

    `start`: the sequences' length before the first new token; `max_length`: the length they stop at (forced
    EOS); `min_new_tokens`: how many new tokens come before an EOS may; `prompts`: the ids whose n-grams
    encoder_no_repeat_ngram_size bans; `prompt_padding`: each row's left padding, which the repetition penalty
    skips; `keep`: the fewest tokens a truncation filter keeps."""
    _check(cfg)
    out = LogitsProcessorList()
    if cfg.sequence_bias is not None:
        out.append(sequence_bias_table(cfg.sequence_bias, vocab_size))
    if cfg.repetition_penalty != 1.0:
        out.append(RepetitionPenalty(cfg.repetition_penalty, prompt_padding))
    if cfg.no_repeat_ngram_size:
        out.append(NoRepeatNGram(cfg.no_repeat_ngram_size))
    if cfg.encoder_no_repeat_ngram_size:
        out.append(EncoderNoRepeatNGram(prompts, cfg.encoder_no_repeat_ngram_size))
    if cfg.bad_words_ids is not None:
        bad = bad_words_table(cfg.bad_words_ids, eos, vocab_size)
        if bad is not None:
            out.append(bad)
    if min_new_tokens and eos:
        out.append(MinNewTokens(eos, start + min_new_tokens))
    # a forced BOS after a one-token start delays the first free step, as transformers' begin_index does
    begin = start if start > 1 or cfg.forced_bos_token_id is None else start + 1
    if cfg.forced_bos_token_id is not None:
        out.append(ForcedBOS(cfg.forced_bos_token_id))
    if id_list(cfg.forced_eos_token_id):
        out.append(ForcedEOS(id_list(cfg.forced_eos_token_id), max_length))
    if cfg.suppress_tokens is not None:
        out.append(SuppressTokens(list(cfg.suppress_tokens)))
    if cfg.begin_suppress_tokens is not None:
        out.append(SuppressTokens(list(cfg.begin_suppress_tokens), at=begin))
    if cfg.do_sample:
        top_k = 50 if cfg.top_k is None else cfg.top_k
        if cfg.temperature != 1.0:
            out.append(Temperature(cfg.temperature))
        if top_k:
            out.append(Truncation(top_k_filter, top_k, keep))
        if cfg.top_p is not None and cfg.top_p < 1.0:
            out.append(Truncation(top_p_filter, cfg.top_p, keep))
        if cfg.min_p is not None:
            out.append(Truncation(min_p_filter, cfg.min_p, keep))
        if cfg.typical_p is not None and cfg.typical_p < 1.0:
            out.append(Truncation(typical_filter, cfg.typical_p, keep))
        if cfg.epsilon_cutoff:
            out.append(Truncation(epsilon_filter, cfg.epsilon_cutoff, keep))
        if cfg.eta_cutoff:
            out.append(Truncation(eta_filter, cfg.eta_cutoff, keep))
    return out
