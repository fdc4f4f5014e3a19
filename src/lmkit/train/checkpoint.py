"""Trainer checkpoints: safetensors for model and optimizer tensors, JSON for everything else.

Layout under the run folder:  checkpoint/step-00000100/{model,optimizer}.safetensors + state.json,
and checkpoint/latest.json naming the newest complete one. A checkpoint is written into a
temporary folder, renamed into place, and only then named by latest.json (atomic replace),
so a run killed at any moment leaves the previous checkpoint intact.
"""
from __future__ import annotations

import base64
import json
import os
import random
import shutil
import tempfile
from pathlib import Path
from typing import Any

import numpy as np
import torch
from safetensors.torch import load_file, load_model, save_file, save_model

from lmkit.data.cache import umask, atomic_write_json
from lmkit.errors import CheckpointError

CHECKPOINT_DIR = "checkpoint"


# RNG state as JSON ----------------------------------------------------------------------------

def rng_state() -> dict[str, Any]:
    """torch (bytes in base64), Python `random` and numpy global states, JSON-serializable."""
    version, internal, gauss = random.getstate()
    np_state = np.random.get_state()
    return {
        "torch": base64.b64encode(torch.get_rng_state().numpy().tobytes()).decode("ascii"),
        "python": [version, list(internal), gauss],
        "numpy": [np_state[0], np_state[1].tolist(), int(np_state[2]), int(np_state[3]), float(np_state[4])],
    }


def set_rng_state(state: dict[str, Any]) -> None:
    torch.set_rng_state(torch.frombuffer(bytearray(base64.b64decode(state["torch"])), dtype=torch.uint8))
    version, internal, gauss = state["python"]
    random.setstate((version, tuple(internal), gauss))
    name, keys, pos, has_gauss, cached = state["numpy"]
    np.random.set_state((name, np.array(keys, dtype=np.uint32), pos, has_gauss, cached))


# optimizer state: tensors apart from the rest ---------------------------------------------------

def _split_optimizer(sd: dict) -> tuple[dict[str, torch.Tensor], dict]:
    tensors, rest = {}, {"param_groups": sd["param_groups"], "state": {}}
    for pid, entries in sd["state"].items():
        rest["state"][str(pid)] = {}
        for name, value in entries.items():
            if isinstance(value, torch.Tensor):
                tensors[f"{pid}.{name}"] = value.detach().contiguous()
                rest["state"][str(pid)][name] = {"tensor": f"{pid}.{name}"}
            else:
                rest["state"][str(pid)][name] = value
    return tensors, rest


def _join_optimizer(tensors: dict[str, torch.Tensor], rest: dict) -> dict:
    state = {}
    for pid, entries in rest["state"].items():
        state[int(pid)] = {name: tensors[v["tensor"]] if isinstance(v, dict) and "tensor" in v else v
                           for name, v in entries.items()}
    return {"state": state, "param_groups": rest["param_groups"]}


# save / load --------------------------------------------------------------------------------------

def latest_checkpoint(run_dir: str | Path) -> Path | None:
    """The newest complete checkpoint folder of a run, or None."""
    pointer = Path(run_dir, CHECKPOINT_DIR, "latest.json")
    if not pointer.exists():
        return None
    try:
        name = json.loads(pointer.read_text(encoding="utf-8"))["path"]
    except (ValueError, KeyError, TypeError):
        raise CheckpointError(f"{pointer} is damaged; start a new run (another --out) or fix the file") from None
    path = Path(run_dir, CHECKPOINT_DIR, name)
    if not (path / "state.json").exists():
        raise CheckpointError(f"{pointer} names {name}, which is missing; start a new run or restore it")
    return path


def save_checkpoint(run_dir: str | Path, step: int, model: torch.nn.Module, optimizer: torch.optim.Optimizer,
                    state: dict[str, Any]) -> Path:
    """Write checkpoint `step` atomically, point latest.json at it, and delete older ones."""
    root = Path(run_dir, CHECKPOINT_DIR)
    root.mkdir(parents=True, exist_ok=True)
    name = f"step-{step:08d}"
    tmp = Path(tempfile.mkdtemp(prefix=f".{name}.", dir=root))
    try:
        os.chmod(tmp, 0o777 & ~umask())  # mkdtemp makes 0700; give the folder the usual mode
        save_model(model, str(tmp / "model.safetensors"))
        tensors, rest = _split_optimizer(optimizer.state_dict())
        save_file(tensors, str(tmp / "optimizer.safetensors"))
        atomic_write_json(tmp / "state.json", {**state, "step": step, "optimizer": rest, "rng": rng_state()})
        final = root / name
        if final.exists():
            shutil.rmtree(final)
        os.replace(tmp, final)
    except BaseException:
        shutil.rmtree(tmp, ignore_errors=True)
        raise
    atomic_write_json(root / "latest.json", {"path": name, "step": step})
    for old in root.iterdir():
        if old.name != name and old.name != "latest.json":
            shutil.rmtree(old, ignore_errors=True) if old.is_dir() else old.unlink(missing_ok=True)
    return final


def load_checkpoint(path: str | Path, model: torch.nn.Module, optimizer: torch.optim.Optimizer | None) -> dict[str, Any]:
    """Restore model, optimizer and RNG states from a checkpoint folder; return its state.json."""
    path = Path(path)
    try:
        state = json.loads((path / "state.json").read_text(encoding="utf-8"))
        missing, unexpected = load_model(model, str(path / "model.safetensors"), strict=False)
        if missing or unexpected:
            raise CheckpointError(f"checkpoint {path} does not match the model (missing {sorted(missing)[:3]}, "
                                  f"unexpected {sorted(unexpected)[:3]}); resume with the same --preset")
        if optimizer is not None:
            tensors = load_file(str(path / "optimizer.safetensors"))
            optimizer.load_state_dict(_join_optimizer(tensors, state["optimizer"]))
    except (OSError, ValueError, KeyError) as exc:
        raise CheckpointError(f"checkpoint {path} cannot be read ({exc}); start a new run or restore it") from None
    set_rng_state(state["rng"])
    return state


def run_settings(run_dir: str | Path) -> dict[str, Any] | None:
    """The TrainConfig (as a dict) of the run whose folder this is, or None for other model folders."""
    try:
        path = latest_checkpoint(run_dir)
        return json.loads((path / "state.json").read_text(encoding="utf-8"))["train_config"] if path else None
    except (CheckpointError, OSError, ValueError, KeyError):
        return None
