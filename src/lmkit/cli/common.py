"""Flags that several commands share, added by one helper each so that they read the same everywhere."""
from __future__ import annotations

import argparse

DEVICE_HELP = "where the model runs: auto (CUDA, then MPS, then CPU; the default), cpu, cuda, cuda:N or mps"


def add_device_argument(parser: argparse.ArgumentParser) -> None:
    """--device auto|cpu|cuda[:N]|mps; `lmkit.cli.main` resolves it to a torch.device before the command runs."""
    parser.add_argument("--device", default="auto", metavar="auto|cpu|cuda[:N]|mps", help=DEVICE_HELP)


def device_of(args: argparse.Namespace):
    """The torch.device of a command's --device (auto when the namespace has none)."""
    from lmkit.device import resolve_device

    return resolve_device(getattr(args, "device", None))
