"""Compression: distillation (DistilBERT recipe), attention-head pruning, dynamic int8 quantization."""
from lmkit.compress.distill import DistillWeights, distill_causal_lm, distillation_loss, student_from_teacher
from lmkit.compress.prune import (apply_head_layout, head_importance, least_important, prune_attention,
                                  prune_heads)
from lmkit.compress.quantize import quantize_dynamic_int8, weight_bytes

__all__ = ["DistillWeights", "distill_causal_lm", "distillation_loss", "student_from_teacher", "apply_head_layout",
           "head_importance", "least_important", "prune_attention", "prune_heads", "quantize_dynamic_int8",
           "weight_bytes"]
