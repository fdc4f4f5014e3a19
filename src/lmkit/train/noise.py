"""BART's five noising functions (Lewis et al. 2019, section 2.2) and their composition (`--noise`).

Each maps a row's tokens to a corrupted copy; the decoder is asked for the original row:
- masking: each token becomes the mask token with probability 0.3 (BERT-style, one mask per token);
- deletion: 10% of the tokens removed, so the model must also find where;
- infilling: spans of Poisson(3) lengths (0-length spans insert a mask) covering 30% of the tokens, each replaced by
  one mask token (`lmkit.objectives.text_infilling`);
- permutation: the sentences (cut after full stops) shuffled;
- rotation: the row rotated to begin at a uniformly chosen token, so the model must find the document's start.
Combined, they apply in the order of fairseq's DenoisingDataset: permutation, masking, infilling, deletion,
rotation. The default is the paper's best, infilling and permutation.
"""
from __future__ import annotations

from typing import Callable

import torch

from lmkit.errors import ConfigError
from lmkit.objectives import sentence_permutation, text_infilling, token_deletion

ORDER = ("permutation", "masking", "infilling", "deletion", "rotation")
DEFAULT_NOISE = "infilling,permutation"
MASK_RATIO = 0.3


def token_masking(tokens: list[int], mask_id: int, ratio: float = MASK_RATIO,
                  generator: torch.Generator | None = None) -> list[int]:
    """Each token replaced by mask_id with probability `ratio`; the length is kept."""
    draw = torch.rand(len(tokens), generator=generator).tolist()
    return [mask_id if d < ratio else t for t, d in zip(tokens, draw)]


def document_rotation(tokens: list[int], generator: torch.Generator | None = None) -> list[int]:
    """The row rotated to start at a uniformly drawn position k: tokens[k:] + tokens[:k]."""
    if len(tokens) < 2:
        return list(tokens)
    k = int(torch.randint(len(tokens), (), generator=generator))
    return tokens[k:] + tokens[:k]


def parse_noise(spec: str | None) -> tuple[str, ...]:
    """`--noise a,b`: the named noisings in their order of application (ORDER); None: the default."""
    names = [n.strip() for n in (spec or DEFAULT_NOISE).split(",") if n.strip()]
    unknown = [n for n in names if n not in ORDER]
    if unknown or not names:
        raise ConfigError(f"--noise {spec!r}: choose one or more of {', '.join(ORDER)}, comma-separated "
                          f"(default {DEFAULT_NOISE}, the BART paper's best)")
    return tuple(n for n in ORDER if n in names)


def noiser(spec: str | None, mask_id: int, end_ids: set[int]) -> Callable[[list[int], torch.Generator], list[int]]:
    """The function tokens -> corrupted tokens of `--noise spec`, each noising drawing from the given generator."""
    steps = {
        "permutation": lambda t, g: sentence_permutation(t, end_ids, g),
        "masking": lambda t, g: token_masking(t, mask_id, generator=g),
        "infilling": lambda t, g: text_infilling(t, mask_id, generator=g),
        "deletion": lambda t, g: token_deletion(t, generator=g),
        "rotation": lambda t, g: document_rotation(t, g),
    }
    chosen = [steps[n] for n in parse_noise(spec)]

    def corrupt(tokens: list[int], generator: torch.Generator | None = None) -> list[int]:
        for step in chosen:
            tokens = step(tokens, generator)
        return tokens

    return corrupt
