"""Helpers that test modules in several folders share: tiny reference-library models and their folders, beam-search
checks, bad-input runs of the CLI. A test imports them as `from helpers.NAME import ...` (tests/ is on the path
through its conftest.py); a helper used within one folder stays in that folder's test module."""
