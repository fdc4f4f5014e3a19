"""Reading a model's insides: the logit lens over the residual stream (`logits.py`) and attention
probabilities from its own attention layers (`attention.py`). The vector-to-token decoders they read with
are building blocks (`lmkit.nn.decoders`); the pictures of the readings are `lmkit.plots`."""
from __future__ import annotations

from lmkit.lens.attention import attention_maps, keeping_probabilities
from lmkit.lens.logits import LensReading, lens_logits, logit_lens, residual_stream

__all__ = ["LensReading", "lens_logits", "logit_lens", "residual_stream", "attention_maps", "keeping_probabilities"]
