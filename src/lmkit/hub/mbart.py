"""mBART (MBartForConditionalGeneration / MBartModel): BART's config mapping and weight table (hub/bart.py)
with its layout `bart.LAYOUTS["mbart"]`: pre-norm blocks x + F(LN(x)), a final LayerNorm `layer_norm` after each
stack (besides `layernorm_embedding`), teacher forcing from the labels' last non-pad token (the language code)
wrapped to the front, and generation starting from decoder_start_token_id, else bos_token_id."""
from __future__ import annotations

import dataclasses
from functools import partial

from lmkit.hub import bart

FAMILY = dataclasses.replace(bart.FAMILY, model_types=("mbart",),
                             hf_classes=("MBartForConditionalGeneration", "MBartModel"),
                             config_from_hf=partial(bart.config_from_hf, family="mbart"),
                             config_to_hf=partial(bart.config_to_hf, family="mbart"))
