"""Tokenization models: a pre-token (word) -> token strings -> ids."""
from __future__ import annotations

from lmkit.errors import TokenizerError
from lmkit.tokenizers.models.base import Model
from lmkit.tokenizers.models.bpe import BPE
from lmkit.tokenizers.models.unigram import Unigram
from lmkit.tokenizers.models.wordpiece import WordLevel, WordPiece

MODELS = {"BPE": BPE, "WordPiece": WordPiece, "Unigram": Unigram, "WordLevel": WordLevel}


def model_from_json(d: dict) -> Model:
    kind = d.get("type")
    if kind is None:  # very old files omit the model type; guess from the fields, as HF does
        kind = "BPE" if "merges" in d else "Unigram" if isinstance(d.get("vocab"), list) else "WordPiece" \
            if "continuing_subword_prefix" in d else "WordLevel"
    if kind not in MODELS:
        raise TokenizerError(f"unsupported model type {kind!r} in tokenizer.json; lmkit reads BPE, WordPiece, "
                             "Unigram and WordLevel")
    return MODELS[kind].from_json(d)


__all__ = ["BPE", "MODELS", "Model", "Unigram", "WordLevel", "WordPiece", "model_from_json"]
