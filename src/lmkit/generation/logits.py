"""Logit processors, applied in transformers' order (its `_get_logits_processor`): sequence bias, repetition
penalty, n-gram blocking (of the output, then the prompt's n-grams), bad words, forced BOS/EOS, suppressed tokens;
then, for sampling, temperature, top-k, top-p (nucleus), min-p, typical, epsilon and eta truncation. (The
minimum-length EOS ban, which commutes with the first four, is applied by the decoding loops.)

Each takes (sequences (B, T), scores (B, V) float32) and returns new scores. The truncation filters keep at
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


class EncoderNoRepeatNGram:
    """Forbid any token that would complete an n-gram of the row's prompt (the encoder's input ids, padding
    included), however many times the output already holds it: transformers' EncoderNoRepeatNGramLogitsProcessor.
    Rows i*r .. i*r + r - 1 of the sequences (beams or samples of prompt i) share prompt i's n-grams."""

    def __init__(self, prompts: torch.Tensor, n: int):
        self.n, self.tables = n, []
        for row in prompts.tolist():
            table: dict[tuple[int, ...], list[int]] = {}
            for i in range(len(row) - n + 1):
                table.setdefault(tuple(row[i:i + n - 1]), []).append(row[i + n - 1])
            self.tables.append(table)

    def __call__(self, sequences: torch.Tensor, scores: torch.Tensor) -> torch.Tensor:
        length = sequences.shape[1]
        if length + 1 < self.n:
            return scores
        scores = scores.clone()
        per_prompt = scores.shape[0] // len(self.tables)
        for row, prefix in enumerate(sequences[:, length - self.n + 1:].tolist()):
            banned = self.tables[row // per_prompt].get(tuple(prefix))
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


class SequenceBias:
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

    def __call__(self, sequences: torch.Tensor, scores: torch.Tensor) -> torch.Tensor:
        bias = torch.zeros_like(scores)
        bias += self.single.to(scores.device)
        for prefixes, last, biases in self.groups:
            if prefixes.shape[1] > sequences.shape[1]:
                continue
            prefixes, last, biases = prefixes.to(scores.device), last.to(scores.device), biases.to(scores.device)
            match = (sequences[:, None, -prefixes.shape[1]:] == prefixes).all(dim=-1)
            bias.index_add_(1, last, torch.where(match, biases, 0.0).to(bias.dtype))
        return scores + bias


def _token_lists(value, name: str, vocab_size: int) -> list[tuple[int, ...]]:
    if not isinstance(value, (list, tuple)) or not value or any(
            not isinstance(seq, (list, tuple)) or not seq or any(isinstance(t, bool) or not isinstance(t, int)
                                                                  or not 0 <= t < vocab_size for t in seq)
            for seq in value):
        raise GenerationError(f"{name} must be a non-empty list of non-empty lists of token ids below the vocabulary "
                              f"size {vocab_size}, e.g. [[12, 7], [40]]; got {value!r}")
    return [tuple(seq) for seq in value]


def sequence_bias_table(value, vocab_size: int) -> SequenceBias:
    """generate's sequence_bias, [[ids, bias], ...] or {tuple(ids): bias} (a later duplicate wins, as in transformers)."""
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


def suppress(scores: torch.Tensor, tokens: torch.Tensor) -> torch.Tensor:
    """Set the logits of `tokens` to -inf (ids outside the vocabulary are ignored, as in transformers)."""
    banned = torch.isin(torch.arange(scores.shape[-1], device=scores.device), tokens.to(scores.device))
    return torch.where(banned, NEG_INF, scores)


def processor_options(vocab_size: int, eos: list[int], *, forced: tuple = (None, []), prompts=None,
                      no_repeat_ngram_size=0, encoder_no_repeat_ngram_size=0, min_p=None, typical_p=None,
                      epsilon_cutoff=None, eta_cutoff=None, sequence_bias=None, bad_words_ids=None, suppress_tokens=None,
                      begin_suppress_tokens=None) -> dict:
    """`process` keywords for generate's optional processors, checked as transformers checks them; `forced` is the
    (BOS, EOS list) to force and `prompts` the ids whose n-grams encoder_no_repeat_ngram_size bans."""
    for name, value, low_open, high_open in (("min_p", min_p, False, False), ("typical_p", typical_p, True, False),
                                             ("epsilon_cutoff", epsilon_cutoff, False, True),
                                             ("eta_cutoff", eta_cutoff, False, True)):
        if value is not None and (isinstance(value, bool) or not isinstance(value, (int, float))
                                  or value < 0 or value > 1 or (low_open and value == 0) or (high_open and value == 1)):
            bounds = ("(" if low_open else "[") + "0, 1" + (")" if high_open else "]")
            raise GenerationError(f"{name} must be a number in {bounds}, got {value!r}")
    out = dict(min_p=min_p, typical_p=typical_p, epsilon_cutoff=epsilon_cutoff, eta_cutoff=eta_cutoff)
    if sequence_bias is not None:
        out["sequence_bias"] = sequence_bias_table(sequence_bias, vocab_size)
    if bad_words_ids is not None:
        out["bad_words"] = bad_words_table(bad_words_ids, eos, vocab_size)
    for name, value in (("suppress_tokens", suppress_tokens), ("begin_suppress_tokens", begin_suppress_tokens)):
        if value is not None:
            if not isinstance(value, (list, tuple)) or any(isinstance(t, bool) or not isinstance(t, int) for t in value):
                raise GenerationError(f"{name} must be a list of token ids, got {value!r}")
            out[name] = torch.tensor(list(value), dtype=torch.long)
    for name, tokens in (("forced_bos_token_id", [] if forced[0] is None else [forced[0]]),
                         ("forced_eos_token_id", forced[1])):
        if tokens and suppress_tokens is not None and set(tokens) <= set(suppress_tokens):
            raise GenerationError(f"every token of {name} ({sorted(set(tokens))}) is also in suppress_tokens, which "
                                  f"leaves no token at the forced step; remove it from one of them")
    for name, n in (("no_repeat_ngram_size", no_repeat_ngram_size),
                    ("encoder_no_repeat_ngram_size", encoder_no_repeat_ngram_size)):
        if isinstance(n, bool) or not isinstance(n, int) or n < 0:
            raise GenerationError(f"{name} must be an int >= 0 (0 turns it off), got {n!r}")
    if encoder_no_repeat_ngram_size:
        out["encoder_no_repeat"] = EncoderNoRepeatNGram(prompts, encoder_no_repeat_ngram_size)
    return out


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


def block_eos(scores: torch.Tensor, eos: list[int]) -> None:
    """Set the EOS ids' scores to -inf in place (min_new_tokens); ids past the vocabulary, which can never be
    generated, are skipped as transformers' MinNewTokensLengthLogitsProcessor skips them."""
    inside = [e for e in eos if 0 <= e < scores.shape[-1]]
    if inside:
        scores[:, inside] = -float("inf")


def changes_scores(options: dict, forced: tuple) -> bool:
    """Whether `process` with these keywords can change any score (greedy decoding skips it otherwise)."""
    return bool(options["do_sample"] or options["repetition"] != 1.0 or options["no_repeat_ngram_size"]
                or forced[0] is not None or forced[1]
                or any(options.get(k) is not None for k in ("sequence_bias", "bad_words", "suppress_tokens",
                                                             "begin_suppress_tokens", "encoder_no_repeat")))


def process(sequences: torch.Tensor, scores: torch.Tensor, *, do_sample: bool, temperature: float,
            top_k: int | None, top_p: float | None, repetition: float, no_repeat_ngram_size: int,
            prompt_padding: torch.Tensor | None = None, start: int = 0, max_length: int = 0,
            forced: tuple = (None, []), sequence_bias: SequenceBias | None = None,
            bad_words: SequenceBias | None = None, suppress_tokens: torch.Tensor | None = None,
            begin_suppress_tokens: torch.Tensor | None = None, encoder_no_repeat: EncoderNoRepeatNGram | None = None,
            min_p: float | None = None, typical_p: float | None = None, epsilon_cutoff: float | None = None,
            eta_cutoff: float | None = None, keep: int = 1) -> torch.Tensor:
    """All processors the arguments ask for, in transformers' order (prompt_padding: left pads per row).

    `start` is the length the sequences had before the first new token, `max_length` the length they stop
    at (forced EOS), `forced` the (BOS, EOS list) to force."""
    if sequence_bias is not None:
        scores = sequence_bias(sequences, scores)
    if repetition != 1.0:
        scores = repetition_penalty(sequences, scores, repetition, prompt_padding)
    if no_repeat_ngram_size:
        scores = no_repeat_ngram(sequences, scores, no_repeat_ngram_size)
    if encoder_no_repeat is not None:
        scores = encoder_no_repeat(sequences, scores)
    if bad_words is not None:
        scores = bad_words(sequences, scores)
    if forced[0] is not None or forced[1]:
        scores = force_tokens(scores, sequences.shape[1], max_length, *forced)
    if suppress_tokens is not None:
        scores = suppress(scores, suppress_tokens)
    # a forced BOS after a one-token start delays the first free step, as transformers' begin_index does
    if begin_suppress_tokens is not None \
            and sequences.shape[1] == (start if start > 1 or forced[0] is None else start + 1):
        scores = suppress(scores, begin_suppress_tokens)
    if do_sample:
        if temperature != 1.0:
            scores = scores / temperature
        if top_k:
            scores = top_k_filter(scores, top_k, keep)
        if top_p is not None and top_p < 1.0:
            scores = top_p_filter(scores, top_p, keep)
        if min_p is not None:
            scores = min_p_filter(scores, min_p, keep)
        if typical_p is not None and typical_p < 1.0:
            scores = typical_filter(scores, typical_p, keep)
        if epsilon_cutoff:
            scores = epsilon_filter(scores, epsilon_cutoff, keep)
        if eta_cutoff:
            scores = eta_filter(scores, eta_cutoff, keep)
    return scores


def force_tokens(scores: torch.Tensor, cur_len: int, max_length: int, bos: int | None = None,
                 eos: list[int] | tuple = ()) -> torch.Tensor:
    """transformers' forced BOS / EOS: after a one-token sequence only `bos` may come; the token that
    reaches max_length must be an EOS. The forced tokens get score 0, all others -inf."""
    if bos is not None and cur_len == 1:
        scores = torch.full_like(scores, NEG_INF)
        scores[:, bos] = 0
    if eos and cur_len == max_length - 1:
        scores = torch.full_like(scores, NEG_INF)
        scores[:, list(eos)] = 0
    return scores


def count_penalties(scores: torch.Tensor, output: list[int], presence: float, frequency: float) -> torch.Tensor:
    """OpenAI's presence and frequency penalties: logit_t - presence * [c_t > 0] - frequency * c_t, where c_t counts
    token t in the output so far (the prompt not included)."""
    if not output or (presence == 0 and frequency == 0):
        return scores
    counts = torch.bincount(torch.tensor(output, device=scores.device), minlength=scores.shape[-1])[:scores.shape[-1]]
    return scores - presence * (counts > 0).to(scores.dtype) - frequency * counts.to(scores.dtype)
