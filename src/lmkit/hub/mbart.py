"""mBART (MBartForConditionalGeneration / MBartModel): BART's config mapping and weight table (hub/bart.py)
with its layout `bart.LAYOUTS["mbart"]`: pre-norm blocks x + F(LN(x)), a final LayerNorm `layer_norm` after each
stack (besides `layernorm_embedding`), teacher forcing from the labels' last non-pad token (the language code)
wrapped to the front, and generation starting from decoder_start_token_id, else bos_token_id."""
from __future__ import annotations

from functools import partial

from lmkit.hub import bart
from lmkit.hub.bart import ALIASES, prepare_weights, rules

MODEL_TYPES = ("mbart",)
config_from_hf = partial(bart.config_from_hf, family="mbart")
config_to_hf = partial(bart.config_to_hf, family="mbart")
__all__ = ["ALIASES", "MODEL_TYPES", "config_from_hf", "config_to_hf", "prepare_weights", "rules"]
