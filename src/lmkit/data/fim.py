"""Fill-in-the-middle (Bavarian et al. 2022; StarCoder/SantaCoder's sentinels and layouts).

A document is cut at two character offsets drawn uniformly from 0..len (sorted) into prefix, middle and
suffix; each part is tokenized on its own and the three are laid out with sentinel tokens, as bigcode's
Megatron-LM does:

    PSM  <fim_prefix> prefix <fim_suffix> suffix <fim_middle> middle
    SPM  <fim_prefix> <fim_suffix> suffix <fim_middle> prefix middle

so the middle is learned left to right after the context it fills. Length is kept per piece: a FIM piece
longer than the tokens it replaces loses tokens from the end of its suffix (or stays plain when the suffix
is too short), a shorter one pads its suffix with `<fim_pad>`. Infilling at inference is the PSM prompt
up to `<fim_middle>`; the model writes the middle and ends it with EOS.
"""
from __future__ import annotations

from dataclasses import dataclass
from typing import Any, Callable

from lmkit.data.tokenize import PAD
from lmkit.errors import GenerationError

FIM_PREFIX, FIM_MIDDLE, FIM_SUFFIX, FIM_PAD = "<fim_prefix>", "<fim_middle>", "<fim_suffix>", "<fim_pad>"
SENTINELS = (FIM_PREFIX, FIM_MIDDLE, FIM_SUFFIX, FIM_PAD)


@dataclass(frozen=True)
class FimIds:
    prefix: int
    middle: int
    suffix: int
    pad: int


def add_sentinels(tok: Any) -> FimIds:
    """The tokenizer's FIM sentinel ids, adding the missing ones as special tokens (at the end of the vocabulary)."""
    missing = [s for s in SENTINELS if tok.token_to_id(s) is None]
    if missing:
        tok.add_special_tokens(missing)
    return FimIds(*(int(tok.token_to_id(s)) for s in SENTINELS))


def sentinel_ids(tok: Any, where: str = "the model") -> FimIds:
    """The tokenizer's FIM sentinel ids; a clear error when it has none (a model not trained with FIM)."""
    ids = [tok.token_to_id(s) for s in SENTINELS[:3]]
    if any(i is None for i in ids):
        raise GenerationError(f"{where} has no fill-in-the-middle tokens ({', '.join(SENTINELS[:3])}), so it cannot "
                              "infill; use a model trained with `lmkit train --objective fim`, or give a plain prompt")
    pad = tok.token_to_id(FIM_PAD)
    return FimIds(*(int(i) for i in ids), int(ids[0] if pad is None else pad))


def infill_bos(tok: Any, bos_id: int | None) -> int | None:
    """BOS for an infill prompt: lmkit's training rows (a tokenizer with lmkit's `<|pad|>`) begin with it, a
    pretrained FIM model's (StarCoder's) prompt starts at <fim_prefix>."""
    return bos_id if tok.token_to_id(PAD) is not None else None


def split_points(length: int, draw: Callable[[int], int]) -> tuple[int, int]:
    """Two character offsets, each uniform on 0..length (draw(n) gives an integer in [0, n)), sorted."""
    a, b = draw(length + 1), draw(length + 1)
    return (a, b) if a <= b else (b, a)


def encode(tok: Any, text: str) -> list[int]:
    """Ids of `text` with no special tokens (an lmkit Encoding or a plain list)."""
    if not text:
        return []
    out = tok.encode(text, add_special_tokens=False)
    return list(getattr(out, "ids", out))


def fim_layout(prefix: list[int], middle: list[int], suffix: list[int], ids: FimIds, spm: bool) -> list[int]:
    """The token layout of one FIM example: PSM, or SPM (bigcode's variant: both sentinels lead)."""
    if spm:
        return [ids.prefix, ids.suffix] + suffix + [ids.middle] + prefix + middle
    return [ids.prefix] + prefix + [ids.suffix] + suffix + [ids.middle] + middle


def fim_piece(tokens: list[int], tok: Any, ids: FimIds, cut: tuple[int, int], spm: bool) -> list[int]:
    """A piece of a document (its token ids, no BOS) as a FIM example of the same length, cut at the character
    offsets `cut` of its text; the piece unchanged where the suffix is too short to make room for the sentinels."""
    text = tok.decode(tokens)
    parts = [text[:cut[0]], text[cut[0]:cut[1]], text[cut[1]:]]
    prefix, middle, suffix = (encode(tok, p) for p in parts)
    extra = len(prefix) + len(middle) + len(suffix) + 3 - len(tokens)
    if extra > len(suffix):
        return list(tokens)
    suffix = suffix[:len(suffix) - extra] if extra > 0 else suffix + [ids.pad] * -extra
    return fim_layout(prefix, middle, suffix, ids, spm)


def infill_prompt(tok: Any, prefix: str, suffix: str, bos: int | None = None, where: str = "the model") -> list[int]:
    """The prompt ids that ask a FIM model for the middle between `prefix` and `suffix` (PSM, as StarCoder is
    prompted): [BOS] <fim_prefix> prefix <fim_suffix> suffix <fim_middle>."""
    ids = sentinel_ids(tok, where)
    if not prefix and not suffix:
        raise GenerationError("infilling needs some text around the gap: give a prefix, a suffix or both")
    return ([] if bos is None else [bos]) + fim_layout(encode(tok, prefix), [], encode(tok, suffix), ids, spm=False)
