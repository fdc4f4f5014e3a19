"""`lmkit serve`: an OpenAI-compatible HTTP server over the continuous-batching engine, and a web chat page."""
from lmkit.serve.app import build_app

__all__ = ["build_app"]
