"""What a resumed run takes from its checkpoint, what it takes from the user, and what must not change."""
from __future__ import annotations

import dataclasses
import json
from pathlib import Path
from typing import Any

from lmkit.config import ModelConfig
from lmkit.errors import CheckpointError, TrainingError
from lmkit.train.config import RUN_DEFINING, TrainConfig

# settings a resumed run takes from the user when given: how long, how often, how it is laid out
USER_SETTINGS = ("max_steps", "time_budget", "log_every", "save_every", "eval_every", "eval_batch_size", "progress",
                 "keep_checkpoints", "fsdp")


def load_checkpoint_state(path: Path) -> dict[str, Any]:
    try:
        return json.loads((path / "state.json").read_text(encoding="utf-8"))
    except (OSError, ValueError) as exc:
        raise CheckpointError(f"{path / 'state.json'} cannot be read ({exc}); start a new run") from None


def resume_config(cfg: TrainConfig, saved: dict[str, Any], explicit: set[str] | None,
                  content_checked: bool = False) -> TrainConfig:
    """The saved run's settings, with the user's USER_SETTINGS on top.

    `explicit` names the settings the user gave (the CLI's flags); None (the Python API) means every
    setting that differs from `TrainConfig`'s default, so a setting left at its default keeps the
    saved run's value (max_steps=None continues to the planned step count). A run-defining setting
    the user gave must equal the saved one. `fsdp` given turns a DDP run into an FSDP one (a checkpoint
    holds one-process tensors either way); left out, the run keeps how it was trained. With
    `content_checked` (the checkpoint names its data by content) --data / --corpus may name another
    path: `check_same_data` then compares what is read there with what the run was trained on.
    """
    if explicit is None:
        explicit = {f.name for f in dataclasses.fields(TrainConfig) if getattr(cfg, f.name) != _default(f)}
    # runs saved before --optimizer existed trained with AdamW, before --lr-schedule with cosine (the field's default)
    merged = {"optimizer": "adamw", **saved}
    movable = ("data", "corpus") if content_checked else ()
    fields = {f.name: f for f in dataclasses.fields(TrainConfig)}
    for key in RUN_DEFINING:
        mine, theirs = getattr(cfg, key), merged.get(key, _default(fields[key]))
        if key in movable and key in explicit:
            merged[key] = mine
        elif key in explicit and mine is not None and mine != theirs:
            name = f"--{key.replace('_', '-')}" if key in CLI_FLAGS else f"TrainConfig.{key}"
            raise TrainingError(f"{name} {mine} differs from the run being resumed ({theirs}); "
                                f"leave it out, or start a new run with another --out")
    if "optimizer" not in saved and saved.get("preset") == "default":
        # and, with the default preset, without dropout (the preset gained dropout 0.1 along with --optimizer muon);
        # added after the comparison above, so the overrides the run was given still compare equal
        merged["model_overrides"] = {"dropout": 0.0, **(saved.get("model_overrides") or {})}
    for key in USER_SETTINGS:
        if key in explicit or key == "progress":
            merged[key] = getattr(cfg, key)
    merged.update(out=cfg.out, resume=True)
    return TrainConfig(**merged)


# run-defining settings that `lmkit train` takes as flags (the others are the Python API's alone)
CLI_FLAGS = ("preset", "objective", "corpus", "data", "batch_size", "micro_batch_size", "seq_len", "lr", "optimizer",
             "lr_schedule", "warmup_steps", "precision", "seed")


def _default(f: dataclasses.Field) -> Any:
    return f.default_factory() if f.default_factory is not dataclasses.MISSING else f.default


def check_same_data(saved: dict[str, str] | None, current: dict[str, str], cfg: TrainConfig, out: Path) -> None:
    """Refuse to resume on other data: a retrained tokenizer would silently give every id another meaning.

    Both are {"tokenizer_sha256", "content_sha256"}; `saved` is None for checkpoints that predate them.
    """
    if saved is None:
        return
    source = f"--data {cfg.data}" if cfg.data else f"--corpus {' '.join(cfg.corpus)}"
    if saved["tokenizer_sha256"] != current["tokenizer_sha256"]:
        what = "its tokenizer differs"
    elif saved["content_sha256"] != current["content_sha256"]:
        what = "its documents differ"
    else:
        return
    raise TrainingError(f"{source} is not what the run in {out} was trained on ({what}: changed or replaced since?); "
                        "resume with the data the run was trained on, or start a new run with another --out")


def preset_drift(recorded: ModelConfig, preset: ModelConfig, name: str) -> str | None:
    """What the preset now defines otherwise than the model the checkpoint records (None: nothing)."""
    old, new = recorded.to_dict(), preset.to_dict()
    changed = [k for k in old if old[k] != new.get(k)]
    if not changed:
        return None
    return (f"preset {name!r} now gives {', '.join(f'{k}={new.get(k)!r}' for k in changed)}; the resumed run keeps the "
            f"model its checkpoint records ({', '.join(f'{k}={old[k]!r}' for k in changed)})")


def check_architecture(objective, model: ModelConfig, cfg: TrainConfig, recorded: Path | None) -> None:
    """Refuse a model the objective cannot train, naming where its architecture came from: the preset, or the
    model_config that the checkpoint `recorded` holds (a resumed run rebuilds that model, whatever the preset)."""
    position = getattr(objective, "position", None)  # plm trains XLNet's two-stream attention only
    if model.architecture == objective.architecture and position in (None, model.position):
        return
    if recorded is None:
        where, todo = f"preset {cfg.preset!r}", "pick a matching preset"
    else:  # the run's own objective and model disagree: its state.json was edited or written by another version
        where = f"the model recorded in {recorded / 'state.json'} (model_config)"
        todo = "the run's recorded settings do not fit its recorded model; start a new run with another --out"
    wants = f"{objective.architecture} models" + (f" with position {position!r}" if position else "")
    has = model.architecture + (f" with position {model.position!r}" if position else "")
    raise TrainingError(f"--objective {cfg.objective} trains {wants}, but {where} is {has}; {todo}")
