"""The environment of the processes a test starts (the CLI, torchrun's ranks)."""
import os


def process_env() -> dict:
    """os.environ with one intra-op thread per process (two cores are shared) and unbuffered output."""
    return {**os.environ, "OMP_NUM_THREADS": "1", "PYTHONUNBUFFERED": "1"}
