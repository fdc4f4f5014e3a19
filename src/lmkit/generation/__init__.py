"""Decoding: greedy, sampling filters, beam search, stopping and streaming, for every family."""
from lmkit.generation.mixin import DecodingState, GenerateOutput, GenerationMixin

__all__ = ["DecodingState", "GenerateOutput", "GenerationMixin"]
