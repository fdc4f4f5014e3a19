"""Decoding: greedy, sampling filters, beam search, stopping and streaming, for every family."""
from lmkit.generation.config import GenerationConfig
from lmkit.generation.interface import DecodingInterface, DecodingState
from lmkit.generation.mixin import GenerateOutput, GenerationMixin

__all__ = ["GenerationConfig", "DecodingInterface", "DecodingState", "GenerateOutput", "GenerationMixin"]
