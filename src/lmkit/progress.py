"""Progress bars that draw on a terminal only.

Redirected to a file or a pipe, every redraw of a tqdm bar would land in it as text; there the bar is
off, and long jobs report in plain lines of their own (the trainer at each evaluation).
"""
from __future__ import annotations


def progress_bar(enabled: bool = True, **kwargs):
    """A `tqdm.auto` bar, off when `enabled` is false or its stream (stderr by default) is not a terminal."""
    from tqdm.auto import tqdm

    # disable=None: tqdm checks isatty() itself; notebooks' bars treat None as False and keep their widget
    return tqdm(disable=None if enabled else True, **kwargs)
