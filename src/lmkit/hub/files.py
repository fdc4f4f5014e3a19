"""Reading and writing Hugging Face model folders: config.json and (sharded) safetensors.

Everything is written through `lmkit.atomic` (temporary name, fsync, rename), so a crash never
leaves half a file.
"""
from __future__ import annotations

import json
from pathlib import Path

import torch
from safetensors import SafetensorError
from safetensors.torch import load_file, save_file

from lmkit.atomic import atomic_save_file, atomic_write_json
from lmkit.errors import CheckpointError

WEIGHTS = "model.safetensors"
INDEX = "model.safetensors.index.json"
JSON_KINDS = {dict: "object", list: "array"}


def atomic_save_safetensors(tensors: dict[str, torch.Tensor], path: Path, metadata: dict | None = None) -> None:
    """save_file to a temporary name, then rename (tensors made contiguous and unshared first)."""
    tensors = {k: v.detach().contiguous().clone() if _shares(v, tensors) else v.detach().contiguous()
               for k, v in tensors.items()}
    atomic_save_file(path, lambda tmp: save_file(tensors, tmp, metadata=metadata or {"format": "pt"}))


def _shares(t: torch.Tensor, tensors: dict[str, torch.Tensor]) -> bool:
    ptr = t.untyped_storage().data_ptr()
    return sum(1 for v in tensors.values() if v.untyped_storage().data_ptr() == ptr) > 1


def read_json(path: Path, needed_by: str = "a model folder needs config.json and model.safetensors",
              kinds: tuple[type, ...] = (dict,)) -> dict:
    """A folder's JSON file; a missing, broken or wrongly shaped one raises CheckpointError (`needed_by` says
    which folder needs it, `kinds` the JSON types it may hold: a JSON object unless told)."""
    path = Path(path)
    if not path.is_file():
        raise CheckpointError(f"{path} is missing; {needed_by}")
    try:
        data = json.loads(path.read_text(encoding="utf-8"))
    except (json.JSONDecodeError, UnicodeDecodeError) as exc:
        raise CheckpointError(f"{path} is not valid JSON ({exc}); restore it from a good copy or re-save the model") from exc
    if not isinstance(data, kinds):
        raise CheckpointError(f"{path} must hold a JSON {' or '.join(JSON_KINDS[k] for k in kinds)}, "
                              f"found {type(data).__name__}")
    return data


def load_safetensors(path: Path) -> dict[str, torch.Tensor]:
    try:
        return load_file(str(path))
    except (SafetensorError, OSError, ValueError) as exc:
        raise CheckpointError(f"{path} is damaged or truncated ({exc}); re-save or re-download the weights") from exc


def read_weights(folder: Path) -> dict[str, torch.Tensor]:
    """All tensors of a folder: model.safetensors, or the shards its index names."""
    folder = Path(folder)
    if (folder / WEIGHTS).is_file():
        return load_safetensors(folder / WEIGHTS)
    if (folder / INDEX).is_file():
        index = read_json(folder / INDEX)
        weight_map = index.get("weight_map")
        if not isinstance(weight_map, dict):
            raise CheckpointError(f"{folder / INDEX} has no weight_map; re-save the model")
        tensors: dict[str, torch.Tensor] = {}
        for shard in sorted(set(weight_map.values())):
            if not (folder / shard).is_file():
                raise CheckpointError(f"{folder / shard}, named in {INDEX}, is missing")
            tensors.update(load_safetensors(folder / shard))
        missing = sorted(set(weight_map) - set(tensors))
        if missing:
            raise CheckpointError(f"{INDEX} names tensors its shards lack: {', '.join(missing[:5])}")
        return tensors
    if any(folder.glob("*.bin")) or any(folder.glob("*.pt")):
        raise CheckpointError(f"{folder} holds only pickled weights (.bin/.pt), which lmkit never unpickles; "
                              f"convert them to safetensors first")
    raise CheckpointError(f"no {WEIGHTS} or {INDEX} in {folder}")


def write_weights(folder: Path, tensors: dict[str, torch.Tensor], max_shard_bytes: int | None = None) -> None:
    """model.safetensors, or shards plus an index when max_shard_bytes is set and exceeded."""
    folder = Path(folder)
    total = sum(t.numel() * t.element_size() for t in tensors.values())
    if not max_shard_bytes or total <= max_shard_bytes:
        atomic_save_safetensors(tensors, folder / WEIGHTS)
        (folder / INDEX).unlink(missing_ok=True)
        return
    shards: list[dict[str, torch.Tensor]] = [{}]
    size = 0
    for name, t in tensors.items():
        nbytes = t.numel() * t.element_size()
        if shards[-1] and size + nbytes > max_shard_bytes:
            shards.append({})
            size = 0
        shards[-1][name] = t
        size += nbytes
    weight_map = {}
    for i, shard in enumerate(shards):
        fname = f"model-{i + 1:05d}-of-{len(shards):05d}.safetensors"
        atomic_save_safetensors(shard, folder / fname)
        weight_map.update({k: fname for k in shard})
    atomic_write_json(folder / INDEX, {"metadata": {"total_size": total}, "weight_map": weight_map}, sort_keys=True)
    (folder / WEIGHTS).unlink(missing_ok=True)
