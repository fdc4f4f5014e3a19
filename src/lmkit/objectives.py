"""Training objectives: losses as (sum of nats, count of scored tokens), and what they mean.

Keeping the sum and the count apart (instead of a mean) lets gradient accumulation and
several processes average over exactly the tokens scored: mean = sum_i nats_i / count.
Positions whose target is `IGNORE_INDEX` (padding) enter neither the sum nor the count.
"""
from __future__ import annotations

import math
from dataclasses import dataclass

import torch
import torch.nn.functional as F

IGNORE_INDEX = -100


@dataclass
class LossSum:
    """sum: total negative log-likelihood in nats (a tensor); count: number of tokens scored."""

    sum: torch.Tensor
    count: torch.Tensor

    @property
    def mean(self) -> torch.Tensor:
        """Nats per token: sum / count (0 when nothing was scored)."""
        return self.sum / self.count.clamp(min=1)


def with_aux_loss(loss: torch.Tensor, aux: torch.Tensor | None, coef: float, share: int = 1) -> torch.Tensor:
    """loss + coef * aux / share: a mixture of experts' load-balancing loss (Switch Transformer), weighted by
    router_aux_loss_coef, added once per optimizer step (`share` micro-batches or ranks each add 1/share of it).
    aux None (no experts): the loss unchanged."""
    return loss if aux is None else loss + coef * aux.float() / share


def next_token_targets(input_ids: torch.Tensor, attention_mask: torch.Tensor | None = None,
                       ignore_index: int = IGNORE_INDEX) -> tuple[torch.Tensor, torch.Tensor]:
    """(inputs, targets) from rows x_0..x_T that begin with BOS: inputs x_0..x_{T-1}, targets x_1..x_T.

    A target is ignored where attention_mask (B, T + 1) is 0, i.e. at padding.
    """
    inputs, targets = input_ids[:, :-1], input_ids[:, 1:].clone()
    if attention_mask is not None:
        targets[attention_mask[:, 1:] == 0] = ignore_index
    return inputs, targets


def next_token_loss(logits: torch.Tensor, targets: torch.Tensor, ignore_index: int = IGNORE_INDEX) -> LossSum:
    """-sum_t log softmax(logits_t)[y_t] over positions with y_t != ignore_index, in float32.

    logits (B, T, V) are the model's outputs at the input positions; targets (B, T) the next tokens.
    """
    flat = targets.reshape(-1)
    nats = F.cross_entropy(logits.reshape(-1, logits.shape[-1]).float(), flat,
                           ignore_index=ignore_index, reduction="sum")
    return LossSum(nats, (flat != ignore_index).sum())


def perplexity(nats_per_token: float) -> float:
    """exp(mean nats per token); inf when that overflows."""
    try:
        return math.exp(nats_per_token)
    except OverflowError:
        return math.inf


def bits_per_byte(total_nats: float, total_bytes: int) -> float:
    """total nats / (ln 2 * number of UTF-8 bytes of the text scored): tokenizer-independent."""
    if total_bytes <= 0:
        raise ValueError("bits per byte needs at least one byte of text")
    return total_nats / (math.log(2) * total_bytes)


# masked language modelling (BERT, RoBERTa) --------------------------------------------------------

def mask_tokens(input_ids: torch.Tensor, mask_token_id: int, vocab_size: int, special_ids=(),
                attention_mask: torch.Tensor | None = None, mlm_probability: float = 0.15,
                mask_fraction: float = 0.8, random_fraction: float = 0.1, word_starts: torch.Tensor | None = None,
                generator: torch.Generator | None = None,
                ignore_index: int = IGNORE_INDEX) -> tuple[torch.Tensor, torch.Tensor]:
    """BERT's corruption: (inputs, labels) with each eligible position chosen with probability p = 0.15;
    of the chosen, 80% become [MASK], 10% a uniformly random token, 10% stay; labels hold the original id
    at chosen positions and ignore_index elsewhere. Special tokens and padding are never chosen.

    word_starts (B, T) bool turns on whole-word masking: a word (a start and the tokens up to the next
    start) is chosen as a unit with probability p, so each eligible token still has probability p; the
    row's first token and every token after a special or padding token begin words of their own
    (`word_starts` below finds the starts from a tokenizer's pieces). The 80/10/10 draw stays per token,
    as in BERT's create_pretraining_data.py (transformers 5 sets mask_fraction=1 for whole words).
    Random tokens are drawn from the whole vocabulary [0, vocab_size), as transformers does.
    Called with a fresh generator state per batch, this is RoBERTa's dynamic masking.
    """
    # the checks of transformers' DataCollatorForLanguageModeling
    if not 0 <= mlm_probability <= 1:
        raise ValueError(f"mlm_probability must be between 0 and 1, got {mlm_probability}")
    if min(mask_fraction, random_fraction) < 0 or mask_fraction + random_fraction > 1:
        raise ValueError(f"mask_fraction ({mask_fraction}) and random_fraction ({random_fraction}) must be "
                         "non-negative and sum to at most 1 (the rest of the chosen tokens stay unchanged)")
    ids = input_ids
    eligible = torch.ones_like(ids, dtype=torch.bool)
    if attention_mask is not None:
        eligible &= attention_mask.bool()
    if len(special_ids):
        eligible &= ~torch.isin(ids, torch.as_tensor(list(special_ids), device=ids.device))
    draw = torch.rand(ids.shape, generator=generator, device="cpu").to(ids.device)
    if word_starts is not None:
        # word w of a row takes the draw at column w; every token reads the draw of its word. A row cut
        # from a packed stream may open inside a word, and a word never runs across a special token.
        starts = word_starts.bool().clone()
        starts[:, 0] = True
        starts[:, 1:] |= ~eligible[:, :-1]
        word = torch.cumsum(starts.long(), dim=1) - 1
        draw = draw.gather(1, word)
    chosen = (draw < mlm_probability) & eligible
    labels = torch.where(chosen, ids, torch.full_like(ids, ignore_index))
    how = torch.rand(ids.shape, generator=generator, device="cpu").to(ids.device)
    to_mask = chosen & (how < mask_fraction)
    to_random = chosen & (how >= mask_fraction) & (how < mask_fraction + random_fraction)
    random_ids = torch.randint(vocab_size, ids.shape, generator=generator, device="cpu").to(ids.device)
    inputs = torch.where(to_mask, torch.full_like(ids, mask_token_id), ids)
    inputs = torch.where(to_random, random_ids, inputs)
    return inputs, labels


def word_starts(input_ids: torch.Tensor, begins: torch.Tensor, ends: torch.Tensor) -> torch.Tensor:
    """(B, T) bool: token t begins a word when its piece begins one (begins[id], e.g. no `##`, or a leading
    `Ġ`/`▁`) or the piece before it ends in whitespace (ends[id], e.g. a newline token); column 0 always.
    begins and ends are (V,) bool tables, such as `lmkit.tokenizers.words.word_boundaries` builds."""
    begins, ends = begins.to(input_ids.device), ends.to(input_ids.device)
    out = begins[input_ids]
    out[:, 1:] |= ends[input_ids[:, :-1]]
    out[:, 0] = True
    return out


def masked_lm_loss(logits: torch.Tensor, labels: torch.Tensor, ignore_index: int = IGNORE_INDEX) -> LossSum:
    """-sum log softmax(logits_t)[y_t] over the chosen positions only (labels != ignore_index);
    no shift: position t predicts its own original token. mean = sum / number of chosen positions."""
    return next_token_loss(logits, labels, ignore_index)


# permutation language modeling (XLNet) ------------------------------------------------------------------

def span_targets(length: int, goal: int, allowed: list[bool], rng, max_span: int = 5, alpha: int = 6) -> list[bool]:
    """XLNet's target choice: spans of n ~ 1/n over 1..max_span tokens, each inside a context of alpha * n tokens
    (so about 1/alpha of the row), then single allowed tokens at random until `goal` are chosen."""
    chosen, count, cursor = [False] * length, 0, 0
    weights = [1.0 / n for n in range(1, max_span + 1)]
    while cursor < length and count < goal:
        n = min(rng.choices(range(1, max_span + 1), weights)[0], goal - count)
        context = alpha * n
        left = rng.randint(0, context)
        begin = cursor + left
        end = begin + n
        if end > length:
            break
        span = [t for t in range(begin, end) if allowed[t]]
        for t in span:
            chosen[t] = True
        count += len(span)
        cursor = end + context - left
    rest = [t for t in range(length) if allowed[t] and not chosen[t]]
    rng.shuffle(rest)
    for t in rest[:max(goal - count, 0)]:
        chosen[t] = True
    return chosen


def permutation_lm_inputs(input_ids: torch.Tensor, attention_mask: torch.Tensor | None = None, special_ids=(),
                          predict_fraction: float = 1 / 6, max_span: int = 5, perm_size: int | None = None,
                          generator: torch.Generator | None = None) -> dict[str, torch.Tensor]:
    """perm_mask (B, T, T), target_mapping (B, M, T) and labels (B, M) of permutation language modeling.

    Per row a factorization order: the blocks of perm_size positions in turn, each in a fresh random order. The
    targets, M = round(T * predict_fraction) chosen by `span_targets` among real non-special tokens, are predicted
    in that order and hidden from every position not later in it: perm_mask[i, j] = 1 when j is a target (or a
    special token) and rank(j) >= rank(i) for a target i, always for a non-target i. Non-targets are visible to all;
    a target's query stream sees neither itself nor what comes after it. Rows with fewer real tokens get fewer
    targets (labels IGNORE_INDEX, an empty mapping row)."""
    import random

    B, T = input_ids.shape
    block = perm_size or T
    goal = max(1, round(T * predict_fraction))
    real = torch.ones_like(input_ids, dtype=torch.bool) if attention_mask is None else attention_mask.bool()
    func = torch.isin(input_ids, torch.tensor(list(special_ids), dtype=input_ids.dtype, device=input_ids.device)) \
        & real if len(special_ids) else torch.zeros_like(real)
    perm_mask = torch.zeros(B, T, T)
    target_mapping = torch.zeros(B, goal, T)
    labels = torch.full((B, goal), IGNORE_INDEX, dtype=torch.long)
    seed = torch.randint(0, 2**62, (B,), generator=generator)
    for b in range(B):
        rng = random.Random(int(seed[b]))
        allowed = (real[b] & ~func[b]).tolist()
        target = torch.tensor(span_targets(T, min(goal, sum(allowed)), allowed, rng, max_span))
        rank = torch.empty(T, dtype=torch.long)
        for start in range(0, T, block):
            order = list(range(start, min(start + block, T)))
            rng.shuffle(order)
            rank[torch.tensor(order)] = torch.arange(start, start + len(order))
        hidden = target | func[b]  # tokens whose content is revealed only in order
        rank_key = torch.where(hidden, rank, torch.full_like(rank, -1))
        rank_query = torch.where(target, rank, torch.full_like(rank, -1)) + (~target).long()  # non-targets: 0
        perm_mask[b] = ((rank_query[:, None] <= rank_key[None, :]) & hidden[None, :]).float()
        positions = torch.nonzero(target).flatten()
        positions = positions[torch.argsort(rank[positions])]  # predictions listed in factorization order
        target_mapping[b, torch.arange(len(positions)), positions] = 1.0
        labels[b, :len(positions)] = input_ids[b, positions]
    device = input_ids.device
    return {"perm_mask": perm_mask.to(device), "target_mapping": target_mapping.to(device), "labels": labels.to(device)}


# next-sentence prediction (BERT) --------------------------------------------------------------------

def next_sentence_pairs(documents: list[list[list[int]]], cls_id: int, sep_id: int, max_len: int,
                        generator: torch.Generator | None = None, random_fraction: float = 0.5):
    """BERT's NSP examples from documents given as lists of sentences (token ids): for each sentence A
    that has a successor, B is that successor (label 0, IsNext) or, with probability random_fraction,
    a sentence of another document (label 1, NotNext). Each example is [CLS] A [SEP] B [SEP] with
    token types 0 for [CLS] A [SEP] and 1 for B [SEP], cut from the ends of the longer part to max_len.

    Returns a list of (input_ids, token_type_ids, label).
    """
    if max_len < 5:
        raise ValueError("next-sentence pairs need max_len >= 5 ([CLS] a [SEP] b [SEP])")
    others = [d for d in range(len(documents)) if documents[d]]
    if len(others) < 2:
        raise ValueError("next-sentence prediction needs at least two non-empty documents for random pairs")
    examples = []
    for d, sentences in enumerate(documents):
        for i in range(len(sentences) - 1):
            a = list(sentences[i])
            if float(torch.rand((), generator=generator)) < random_fraction:
                choices = [o for o in others if o != d]
                o = choices[int(torch.randint(len(choices), (), generator=generator))]
                b, label = list(documents[o][int(torch.randint(len(documents[o]), (), generator=generator))]), 1
            else:
                b, label = list(sentences[i + 1]), 0
            while len(a) + len(b) > max_len - 3:
                (a if len(a) >= len(b) else b).pop()
            ids = [cls_id] + a + [sep_id] + b + [sep_id]
            examples.append((ids, [0] * (len(a) + 2) + [1] * (len(b) + 1), label))
    return examples


def next_sentence_loss(logits: torch.Tensor, labels: torch.Tensor) -> LossSum:
    """-sum log softmax(logits)[label] over pairs (B, 2) logits, count = number of pairs."""
    return LossSum(F.cross_entropy(logits.float(), labels.reshape(-1), reduction="sum"),
                   torch.tensor(labels.numel(), device=labels.device))


# encoder-decoder objectives: teacher forcing, T5 span corruption, BART denoising ----------------------

def shift_right(labels: torch.Tensor, decoder_start_token_id: int, pad_token_id: int) -> torch.Tensor:
    """Teacher forcing: decoder inputs [start, y_0, ..., y_{T-2}] for targets y; ignored labels read as pad."""
    inputs = labels.new_full(labels.shape, decoder_start_token_id)
    inputs[:, 1:] = labels[:, :-1]
    return inputs.masked_fill(inputs == IGNORE_INDEX, pad_token_id)


def shift_right_wrapped(labels: torch.Tensor, pad_token_id: int) -> torch.Tensor:
    """mBART's teacher forcing: [y_n, y_0, ..., y_{T-2}], y_n the row's last non-pad label (its language code),
    found as transformers finds it: at index (number of non-pad labels) - 1; ignored labels read as pad."""
    labels = labels.masked_fill(labels == IGNORE_INDEX, pad_token_id)
    last = (labels.ne(pad_token_id).sum(dim=1, keepdim=True) - 1).clamp(min=0)
    inputs = labels.roll(1, dims=1)
    inputs[:, :1] = labels.gather(1, last)
    return inputs


def seq2seq_batch(sources: list[list[int]], targets: list[list[int]], pad_id: int,
                  eos_id: int | None = None) -> dict[str, torch.Tensor]:
    """Right-padded input_ids and attention_mask of the sources, labels of the targets (+ EOS) with
    IGNORE_INDEX at padding; the model reads the labels shifted right behind its decoder start token."""
    if eos_id is not None:
        targets = [list(t) + [eos_id] for t in targets]
    S, T = max(1, max(map(len, sources))), max(1, max(map(len, targets)))
    input_ids = torch.full((len(sources), S), pad_id, dtype=torch.long)
    mask = torch.zeros((len(sources), S), dtype=torch.long)
    labels = torch.full((len(targets), T), IGNORE_INDEX, dtype=torch.long)
    for i, (s, t) in enumerate(zip(sources, targets)):
        input_ids[i, :len(s)] = torch.tensor(s, dtype=torch.long)
        mask[i, :len(s)] = 1
        labels[i, :len(t)] = torch.tensor(t, dtype=torch.long)
    return {"input_ids": input_ids, "attention_mask": mask, "labels": labels}


def _random_segmentation(num_items: int, num_segments: int, generator: torch.Generator | None) -> list[int]:
    """A uniformly random split of num_items into num_segments non-empty parts (their lengths)."""
    cuts = torch.randperm(num_items - 1, generator=generator)[:num_segments - 1].sort()[0].tolist()
    bounds = [0] + [c + 1 for c in cuts] + [num_items]
    return [b - a for a, b in zip(bounds, bounds[1:])]


def noise_span_counts(length: int, noise_density: float = 0.15, mean_noise_span_length: float = 3.0) -> tuple[int, int]:
    """(noise tokens, noise spans) of T5's mask for a row of `length` >= 2 tokens: round(length * density)
    tokens (at least 1, at most length - 1) in round(noise / mean span) spans (at least 1)."""
    num_noise = min(max(int(round(length * noise_density)), 1), length - 1)
    num_spans = max(int(round(num_noise / mean_noise_span_length)), 1)
    return num_noise, min(num_spans, num_noise, length - num_noise)


def random_spans_noise_mask(length: int, noise_density: float = 0.15, mean_noise_span_length: float = 3.0,
                            generator: torch.Generator | None = None) -> list[bool]:
    """T5's noise mask: round(length * density) noise tokens in round(noise / mean span) spans, the spans
    and the gaps between them of random lengths, starting with a gap. True marks noise."""
    if length < 2:
        return [False] * length
    num_noise, num_spans = noise_span_counts(length, noise_density, mean_noise_span_length)
    noise = _random_segmentation(num_noise, num_spans, generator)
    keep = _random_segmentation(length - num_noise, num_spans, generator)
    mask: list[bool] = []
    for k, n in zip(keep, noise):
        mask += [False] * k + [True] * n
    return mask


def span_corruption(tokens: list[int], sentinel_ids: list[int], noise_density: float = 0.15,
                    mean_noise_span_length: float = 3.0, generator: torch.Generator | None = None,
                    eos_id: int | None = None) -> tuple[list[int], list[int]]:
    """T5 span corruption: each noise span of the input becomes one sentinel; the target lists each
    sentinel followed by the tokens it hides. Filling every sentinel of the input with its span
    gives back `tokens`. With eos_id, the input ends with it (the target gets it from seq2seq_batch)."""
    mask = random_spans_noise_mask(len(tokens), noise_density, mean_noise_span_length, generator)
    inputs, targets, span = [], [], -1
    for i, (token, noisy) in enumerate(zip(tokens, mask)):
        if noisy and (i == 0 or not mask[i - 1]):
            span += 1
            if span >= len(sentinel_ids):
                raise ValueError(f"span corruption needs more than {len(sentinel_ids)} sentinel tokens; add more "
                                 "or use shorter sequences")
            inputs.append(sentinel_ids[span])
            targets.append(sentinel_ids[span])
        (targets if noisy else inputs).append(token)
    if eos_id is not None:
        inputs.append(eos_id)
    return inputs, targets


def text_infilling(tokens: list[int], mask_id: int, mask_ratio: float = 0.3, poisson_lambda: float = 3.0,
                   generator: torch.Generator | None = None) -> list[int]:
    """BART text infilling: spans with Poisson(lambda) lengths, drawn until they cover exactly
    min(ceil(ratio * n), n) tokens; each run of masked tokens becomes one mask token, and a 0-length span
    inserts a mask token."""
    n = len(tokens)
    budget = math.ceil(n * mask_ratio)
    if n == 0 or budget == 0:
        return list(tokens)
    budget = min(budget, n)
    masked, inserts, covered = [False] * n, set(), 0
    while covered < budget:  # overlaps, the end of the row and 0-length spans can leave a batch of draws short
        rate = torch.tensor([poisson_lambda] * budget, dtype=torch.float)
        lengths = torch.poisson(rate, generator=generator).long().tolist()
        starts = torch.randint(n, (len(lengths),), generator=generator).tolist()
        for length, start in zip(lengths, starts):
            if covered >= budget:
                break
            if length == 0:
                inserts.add(start)
                continue
            length = min(length, budget - covered)
            for i in range(start, min(n, start + length)):
                covered += not masked[i]
                masked[i] = True
    out: list[int] = []
    for i, token in enumerate(tokens):
        if i in inserts and not masked[i] and (not out or out[-1] != mask_id):
            out.append(mask_id)
        if masked[i]:
            if not out or out[-1] != mask_id:
                out.append(mask_id)
        else:
            out.append(token)
    return out


def token_deletion(tokens: list[int], ratio: float = 0.1, generator: torch.Generator | None = None) -> list[int]:
    """BART token deletion: round(ratio * n) randomly chosen tokens removed; the model must find where."""
    drop = set(torch.randperm(len(tokens), generator=generator)[:int(round(len(tokens) * ratio))].tolist())
    return [t for i, t in enumerate(tokens) if i not in drop]


def sentence_permutation(tokens: list[int], end_ids: set[int] | list[int],
                         generator: torch.Generator | None = None) -> list[int]:
    """BART sentence permutation: cut after every token in end_ids (full stops) and shuffle the sentences."""
    ends = set(end_ids)
    sentences, current = [], []
    for t in tokens:
        current.append(t)
        if t in ends:
            sentences.append(current)
            current = []
    if current:
        sentences.append(current)
    order = torch.randperm(len(sentences), generator=generator).tolist()
    return [t for i in order for t in sentences[i]]
