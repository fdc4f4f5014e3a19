"""Semantic search lives in `lmkit.sentence.search`; this name stays importable as the same module."""
import importlib
import sys

sys.modules[__name__] = importlib.import_module("lmkit.sentence.search")
