"""Trainer checkpoints: safetensors for model and optimizer tensors, JSON for everything else.

Layout under the run folder:  checkpoint/step-00000100/{model,optimizer}.safetensors, state.json and
manifest.json (the size and sha256 of each of those files), plus checkpoint/latest.json for people.
A checkpoint is written into a temporary folder, every file flushed to disk (fsync), the folder
renamed into place, and only then are older ones deleted (the last `keep` stay). Resuming takes the
newest checkpoint whose files match its manifest; a damaged one is reported and the one before it
used, so a run killed at any moment, or a disk that mangled the last save, loses at most one save.
"""
from __future__ import annotations

import base64
import hashlib
import json
import os
import random
import re
import shutil
import sys
import tempfile
from pathlib import Path
from typing import Any

import numpy as np
import torch
from safetensors import SafetensorError
from safetensors.torch import load_file, load_model, save_file, save_model

from lmkit.atomic import atomic_write_json, umask
from lmkit.errors import CheckpointError

CHECKPOINT_DIR = "checkpoint"
MANIFEST = "manifest.json"
FILES = ("model.safetensors", "optimizer.safetensors", "state.json")
STEP_DIR = re.compile(r"step-(\d{8,})")


# RNG state as JSON ----------------------------------------------------------------------------

def rng_state() -> dict[str, Any]:
    """torch (bytes in base64; CUDA too when in use), Python `random` and numpy global states, as JSON."""
    version, internal, gauss = random.getstate()
    np_state = np.random.get_state()
    state = {
        "torch": base64.b64encode(torch.get_rng_state().numpy().tobytes()).decode("ascii"),
        "python": [version, list(internal), gauss],
        "numpy": [np_state[0], np_state[1].tolist(), int(np_state[2]), int(np_state[3]), float(np_state[4])],
    }
    if torch.cuda.is_available() and torch.cuda.is_initialized():
        state["cuda"] = base64.b64encode(torch.cuda.get_rng_state().numpy().tobytes()).decode("ascii")
    return state


def set_rng_state(state: dict[str, Any]) -> None:
    torch.set_rng_state(torch.frombuffer(bytearray(base64.b64decode(state["torch"])), dtype=torch.uint8))
    if "cuda" in state and torch.cuda.is_available():
        torch.cuda.set_rng_state(torch.frombuffer(bytearray(base64.b64decode(state["cuda"])), dtype=torch.uint8))
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
                tensors[f"{pid}.{name}"] = value.detach().cpu().contiguous()
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


# integrity --------------------------------------------------------------------------------------

def _sha256(path: Path) -> str:
    h = hashlib.sha256()
    with open(path, "rb") as f:
        while chunk := f.read(1 << 22):
            h.update(chunk)
    return h.hexdigest()


def _fsync(path: Path) -> None:
    fd = os.open(path, os.O_RDONLY)
    try:
        os.fsync(fd)
    finally:
        os.close(fd)


def check_checkpoint(path: Path) -> str | None:
    """None when every file of the checkpoint matches its manifest, else what is wrong."""
    manifest = path / MANIFEST
    if not manifest.is_file():
        return f"{manifest} is missing (the save never finished)"
    try:
        files = json.loads(manifest.read_text(encoding="utf-8"))["files"]
        for name in FILES:
            entry, f = files[name], path / name
            if not f.is_file():
                return f"{f} is missing"
            if f.stat().st_size != entry["size"]:
                return f"{f} is {f.stat().st_size} bytes, its manifest says {entry['size']} (truncated?)"
            if _sha256(f) != entry["sha256"]:
                return f"{f} does not match the sha256 in its manifest (damaged)"
    except (ValueError, KeyError, TypeError, OSError) as exc:
        return f"{manifest} is unreadable ({exc!r})"
    return None


def checkpoints(run_dir: str | Path) -> list[Path]:
    """The run's checkpoint folders, newest first (temporary and foreign entries left out)."""
    root = Path(run_dir, CHECKPOINT_DIR)
    if not root.is_dir():
        return []
    found = [p for p in root.iterdir() if p.is_dir() and STEP_DIR.fullmatch(p.name)]
    return sorted(found, key=lambda p: int(STEP_DIR.fullmatch(p.name).group(1)), reverse=True)


def latest_checkpoint(run_dir: str | Path, warn=None) -> Path | None:
    """The newest checkpoint whose files match its manifest; a damaged newer one is reported and skipped."""
    found = checkpoints(run_dir)
    problems = []
    for path in found:
        problem = check_checkpoint(path)
        if problem is None:
            for p in problems:
                (warn or _warn)(f"lmkit: warning: checkpoint {p[0].name} is damaged ({p[1]}); using {path.name}")
            return path
        problems.append((path, problem))
    if problems:
        raise CheckpointError(f"every checkpoint in {Path(run_dir, CHECKPOINT_DIR)} is damaged (newest: {problems[0][1]}); "
                              "start a new run with another --out, or restore the folder from a backup")
    return None


def _warn(message: str) -> None:
    print(message, file=sys.stderr)


# save / load --------------------------------------------------------------------------------------

def _dedupe(sd: dict[str, torch.Tensor]) -> dict[str, torch.Tensor]:
    """One name per storage (tied weights are saved once; loading with strict=False restores the tie)."""
    seen, out = set(), {}
    for k, v in sd.items():
        key = (v.untyped_storage().data_ptr(), v.storage_offset(), tuple(v.shape))
        if key not in seen:
            seen.add(key)
            out[k] = v.detach().cpu().contiguous()
    return out


def save_checkpoint(run_dir: str | Path, step: int, model: torch.nn.Module | dict, optimizer: torch.optim.Optimizer | dict,
                    state: dict[str, Any], keep: int = 3) -> Path:
    """Write checkpoint `step` atomically with its manifest, then keep only the newest `keep`.

    model / optimizer are modules or (full, one-process) state dicts.
    """
    root = Path(run_dir, CHECKPOINT_DIR)
    root.mkdir(parents=True, exist_ok=True)
    name = f"step-{step:08d}"
    tmp = Path(tempfile.mkdtemp(prefix=f".{name}.", dir=root))
    try:
        os.chmod(tmp, 0o777 & ~umask())  # mkdtemp makes 0700; give the folder the usual mode
        if isinstance(model, torch.nn.Module):
            save_model(model, str(tmp / "model.safetensors"))
        else:
            save_file(_dedupe(model), str(tmp / "model.safetensors"), metadata={"format": "pt"})
        tensors, rest = _split_optimizer(optimizer if isinstance(optimizer, dict) else optimizer.state_dict())
        save_file(tensors, str(tmp / "optimizer.safetensors"))
        atomic_write_json(tmp / "state.json", {**state, "step": step, "optimizer": rest, "rng": state.get("rng", rng_state())})
        files = {}
        for f in FILES:
            _fsync(tmp / f)
            files[f] = {"size": (tmp / f).stat().st_size, "sha256": _sha256(tmp / f)}
        atomic_write_json(tmp / MANIFEST, {"step": step, "files": files})
        _fsync(tmp)
        final = root / name
        if final.exists():
            shutil.rmtree(final)
        os.replace(tmp, final)
        _fsync(root)
    except BaseException as exc:
        shutil.rmtree(tmp, ignore_errors=True)
        if isinstance(exc, (OSError, SafetensorError)):
            raise write_error(f"checkpoint {name} into {root}", exc, "the previous checkpoints are kept") from None
        raise
    atomic_write_json(root / "latest.json", {"path": name, "step": step})
    # checkpoints past this step belong to a run resumed from an older one (a damaged newer save): they go too
    kept = [p for p in checkpoints(run_dir) if int(STEP_DIR.fullmatch(p.name).group(1)) <= step][:max(1, keep)]
    for old in root.iterdir():
        if old.name != "latest.json" and old not in kept:
            shutil.rmtree(old, ignore_errors=True) if old.is_dir() else old.unlink(missing_ok=True)
    return final


def write_error(what: str, exc: BaseException, kept: str) -> CheckpointError:
    """One clear line for a save that failed (disk full, folder not writable): nothing half-written stays."""
    reason = exc.strerror if isinstance(exc, OSError) and exc.strerror else str(exc)
    return CheckpointError(f"cannot write {what} ({reason}); {kept}: free disk space or fix the folder's permissions, "
                           "then continue with --resume")


def read_checkpoint(path: str | Path) -> tuple[dict[str, torch.Tensor], dict, dict[str, Any]]:
    """(model tensors, optimizer state dict, state.json) of a checkpoint folder."""
    path = Path(path)
    try:
        state = json.loads((path / "state.json").read_text(encoding="utf-8"))
        model_sd = load_file(str(path / "model.safetensors"))
        optim_sd = _join_optimizer(load_file(str(path / "optimizer.safetensors")), state["optimizer"])
    except (OSError, ValueError, KeyError, SafetensorError) as exc:
        raise CheckpointError(f"checkpoint {path} cannot be read ({exc}); start a new run or restore it") from None
    return model_sd, optim_sd, state


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
    except (OSError, ValueError, KeyError, SafetensorError, RuntimeError) as exc:
        raise CheckpointError(f"checkpoint {path} cannot be read ({exc}); start a new run or restore it") from None
    set_rng_state(state["rng"])
    return state


def run_settings(run_dir: str | Path) -> dict[str, Any] | None:
    """The TrainConfig (as a dict) of the run whose folder this is, or None for other model folders."""
    try:
        path = latest_checkpoint(run_dir, warn=lambda message: None)
        return json.loads((path / "state.json").read_text(encoding="utf-8"))["train_config"] if path else None
    except (CheckpointError, OSError, ValueError, KeyError):
        return None
