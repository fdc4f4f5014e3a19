"""Decoding: greedy, sampling filters, beam search, stopping and streaming, for every family."""
from lmkit.generation.config import GenerationConfig
from lmkit.generation.mixin import DecodingState, GenerateOutput, GenerationMixin

__all__ = ["GenerationConfig", "DecodingState", "GenerateOutput", "GenerationMixin"]
