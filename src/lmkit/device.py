"""Where a model runs: `--device auto|cpu|cuda[:N]|mps` and `device=` resolved to one `torch.device`.

auto picks CUDA, then MPS (Apple GPUs), then the CPU. Under torchrun a bare "cuda" (or auto on a CUDA machine)
means this process's GPU, cuda:LOCAL_RANK, as torch.distributed's one-GPU-per-rank layout expects.
"""
from __future__ import annotations

import os
import re

from typing import Any

import torch

from lmkit.errors import LmkitError

CHOICES = "auto|cpu|cuda[:N]|mps"
_SPEC = re.compile(r"(auto|cpu|mps|cuda)(?::(\d+))?")


class DeviceError(LmkitError):
    """A --device / device= that names no device of this machine, or is not a device name at all."""


def resolve_device(spec: str | torch.device | None = "auto", flag: str = "--device ") -> torch.device:
    """The torch.device `spec` names ("auto", "cpu", "cuda", "cuda:1", "mps", or a torch.device; None: auto),
    refused with a DeviceError when it is malformed or not on this machine; `flag` names it in that message
    ("--device " on the command line, "device=" in Python)."""
    if isinstance(spec, torch.device):
        spec = str(spec)
    text = "auto" if spec is None else str(spec).strip().lower()
    match = _SPEC.fullmatch(text)
    if match is None or (match.group(2) is not None and match.group(1) != "cuda"):
        raise DeviceError(f"{flag}{spec}: not a device name; use one of {CHOICES} (cuda:1 for the second GPU)")
    kind, index = match.group(1), match.group(2)
    if kind == "auto":
        if torch.cuda.is_available():
            return torch.device("cuda", _local_rank())
        return torch.device("mps") if _mps_available() else torch.device("cpu")
    if kind == "cpu":
        return torch.device("cpu")
    if kind == "mps":
        if not _mps_available():
            raise DeviceError(f"{flag}{spec}: no MPS device is available (torch.backends.mps.is_available() is "
                              f"False; MPS is Apple silicon's GPU); use {flag}cpu or auto")
        return torch.device("mps")
    if not torch.cuda.is_available():
        raise DeviceError(f"{flag}{spec}: no CUDA device is visible (torch.cuda.is_available() is False); "
                          f"use {flag}cpu or auto")
    n = torch.cuda.device_count()
    i = _local_rank() if index is None else int(index)
    if i >= n:
        raise DeviceError(f"{flag}{spec}: this machine has {n} CUDA device{'s' if n != 1 else ''} "
                          f"(cuda:0..cuda:{n - 1}); pick one of them, or check CUDA_VISIBLE_DEVICES")
    return torch.device("cuda", i)


def module_device(module: torch.nn.Module) -> torch.device:
    """The device of a module's first parameter (else first buffer); the CPU for a module with neither."""
    for tensor in module.parameters():
        return tensor.device
    for tensor in module.buffers():
        return tensor.device
    return torch.device("cpu")


def place(model: torch.nn.Module, device: str | torch.device | None) -> torch.nn.Module:
    """`model` moved to the resolved `device` (None: left where it is), as transformers' `.to(device)`."""
    return model if device is None else model.to(resolve_device(device, "device="))


def _local_rank() -> int:
    """This process's GPU under torchrun (LOCAL_RANK), else the first."""
    if int(os.environ.get("WORLD_SIZE", "1")) > 1:
        return int(os.environ.get("LOCAL_RANK", "0"))
    return 0


def _mps_available() -> bool:
    mps = getattr(torch.backends, "mps", None)
    return bool(mps is not None and mps.is_available())


def to_device(batch: Any, device: torch.device) -> Any:
    """`batch` (a tensor, or tensors in dicts, lists and tuples, made on the host) on `device`; to a GPU through
    pinned memory without blocking, so the copy overlaps the kernels already queued (already there: itself)."""
    if isinstance(batch, torch.Tensor):
        if device.type == "cuda" and batch.device.type == "cpu":
            return batch.pin_memory().to(device, non_blocking=True)
        return batch.to(device)
    if isinstance(batch, dict):
        return {k: to_device(v, device) for k, v in batch.items()}
    if isinstance(batch, (list, tuple)):
        return type(batch)(to_device(v, device) for v in batch)
    return batch
