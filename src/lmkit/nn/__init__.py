"""Building blocks of transformers: embeddings, positions, norms, attention, FFNs, blocks."""
from lmkit.nn.attention import Attention, KVCache
from lmkit.nn.blocks import Block, Residual, build_ffn
from lmkit.nn.embeddings import Embeddings
from lmkit.nn.ffn import FeedForward
from lmkit.nn.masks import build_attention_bias
from lmkit.nn.norms import LayerNorm, RMSNorm, build_norm
from lmkit.nn.positions import RelativePositionBias, RotaryEmbedding, apply_rotary, sinusoidal_table

__all__ = [
    "Attention", "KVCache", "Block", "Residual", "build_ffn", "Embeddings", "FeedForward", "build_attention_bias",
    "LayerNorm", "RMSNorm", "build_norm", "RelativePositionBias", "RotaryEmbedding", "apply_rotary",
    "sinusoidal_table",
]
