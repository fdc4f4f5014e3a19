"""Attention maps live in `lmkit.lens.attention`; this name stays importable as the same module."""
import importlib
import sys

sys.modules[__name__] = importlib.import_module("lmkit.lens.attention")
