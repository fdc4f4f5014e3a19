"""Metrics: perplexity and bits per byte (BLEU, ROUGE and accuracy live beside them)."""
from lmkit.evaluate.perplexity import evaluate_rows, evaluate_text

__all__ = ["evaluate_rows", "evaluate_text"]
