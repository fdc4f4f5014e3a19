"""A training run's set-up, resolved once: the settings (merged with the checkpoint a --resume continues), the
preset, the data, the model config and the model, each checked before the first step.

`prepare_training` makes no collective call: under torchrun each rank runs it, and the trainer then learns
whether every rank got through it (`distributed.agree_on_setup`).
"""
from __future__ import annotations

import dataclasses
import sys
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch

from lmkit.config import ModelConfig, get_preset
from lmkit.data import load_corpus
from lmkit.data.corpus import refuse_output_folder
from lmkit.data.documents import Corpus
from lmkit.data.mixture import MixedStream, corpus_specs, parse_mixture
from lmkit.data.shards import open_prepared, prepared_fingerprint
from lmkit.data.stream import PackedStream, eval_rows, tokenize_corpus
from lmkit.data.tokenize import corpus_tokenizer, special_ids, tokenizer_sha, vocab_size_of
from lmkit.errors import TrainingError
from lmkit.hub import check_savable
from lmkit.models import build_model
from lmkit.train.checkpoint import FILES as CHECKPOINT_FILES, MANIFEST, latest_checkpoint
from lmkit.train.config import TrainConfig
from lmkit.train.denoise import seq2seq_run_settings
from lmkit.train.resume import (check_architecture, check_same_data, load_checkpoint_state, preset_drift,
                               resume_config)
from lmkit.train.seeds import seed_int
from lmkit.train.objectives import get_objective

TOKENIZER_FILES = ("tokenizer.json", "tokenizer_config.json", "special_tokens_map.json")
# what a run writes into --out (a checkpoint's files stand for all of them): none may be read as its corpus
RUN_FILES = TOKENIZER_FILES + ("config.json", "model.safetensors", "metrics.jsonl", "loss_curve.png",
                               "checkpoint/latest.json", *(f"checkpoint/step-00000001/{f}" for f in (*CHECKPOINT_FILES, MANIFEST)))


@dataclass
class RunData:
    """The tokenizer, the training stream and the validation rows of a run."""

    tokenizer: Any
    stream: Any                      # PackedStream, or the prepared shards' stream: rows(seed, step, batch, ...)
    bos_id: int
    pad_id: int
    val_rows: torch.Tensor
    val_mask: torch.Tensor
    val_bytes: int
    identity: dict[str, str]         # {"tokenizer_sha256", "content_sha256"}: a resumed run must read the same


@dataclass
class TrainingSetup:
    """Everything a `Trainer` is built from."""

    cfg: TrainConfig                 # resolved: every default filled in, a resumed run's settings merged
    out: Path
    checkpoint: Path | None          # the latest checkpoint in `out` (the one --resume continues)
    objective: Any                   # train.objectives.Objective, prepared for the tokenizer
    data: RunData
    model_config: ModelConfig        # the preset (or the checkpoint's model) with the run's vocabulary and ids
    model: torch.nn.Module           # built from model_config, in training mode on the device


def prepare_training(cfg: TrainConfig, explicit: set[str] | None = None, rank: int = 0, world_size: int = 1,
                     device: torch.device | str = "cpu") -> TrainingSetup:
    """Check --out, merge a resumed run's settings, resolve the preset, read the data and build the model."""
    out = Path(cfg.out)
    blocker = next((p for p in (out, *out.parents) if p.exists() and not p.is_dir()), None)
    if blocker is not None:
        raise TrainingError(f"--out {out}: {blocker} is a file, not a folder; choose another --out")
    quiet = None if rank == 0 else lambda message: None  # rank 0 alone reports a damaged checkpoint
    checkpoint = latest_checkpoint(out, warn=quiet) if out.exists() else None
    saved: dict[str, Any] = {}
    if cfg.resume:
        if checkpoint is None:
            raise TrainingError(f"--resume: {out} holds no checkpoint to resume; drop --resume to start a new run")
        saved = load_checkpoint_state(checkpoint)
        cfg = resume_config(cfg, saved["train_config"], explicit, content_checked="data" in saved)
    elif checkpoint is not None:
        raise TrainingError(f"{out} already holds a training run; pass --resume to continue it, "
                            "or choose another --out (or remove that folder)")
    preset = get_preset(cfg.preset, **cfg.model_overrides)
    cfg = cfg.resolved(preset, device)
    if not cfg.data:
        refuse_output_folder(corpus_specs(cfg.corpus), "--out", out, RUN_FILES)
    if cfg.batch_size % world_size:  # each rank reads an equal slice of the global batch
        raise TrainingError(f"--batch-size {cfg.batch_size} does not divide among the {world_size} processes; "
                            f"pick a multiple of {world_size}")
    objective = get_objective(cfg.objective)
    if hasattr(objective, "configured"):  # objectives with settings of their own (fim: --fim-rate, --fim-spm-rate)
        objective = objective.configured(cfg)
    # a resumed run rebuilds the model its checkpoint records (older checkpoints: the preset's)
    recorded = "model_config" in saved
    base = ModelConfig.from_dict(saved["model_config"]) if recorded else preset
    check_architecture(objective, base, cfg, checkpoint if recorded else None)
    data, objective = prepare_data(cfg, objective, base.vocab_size)
    model_config = run_model_config(base, cfg, objective, data)
    if cfg.resume:
        check_same_data(saved.get("data"), data.identity, cfg, out)
        note = preset_drift(model_config, run_model_config(preset, cfg, objective, data), cfg.preset)
        if note and rank == 0:
            print(f"lmkit: note: {note}", file=sys.stderr)
    model = init_model(model_config, cfg.seed, device)
    return TrainingSetup(cfg, out, checkpoint, objective, data, model_config, model)


def init_model(model_config: ModelConfig, seed: int, device: torch.device | str) -> torch.nn.Module:
    """The run's model, initialised from the run's seed, checked savable, in training mode on `device`."""
    torch.manual_seed(seed_int("init", seed))
    model = build_model(model_config).to(torch.device(device))
    check_savable(model)  # a format that cannot hold the model is refused now, not at the first save
    model.train()
    return model


def prepare_data(cfg: TrainConfig, objective, vocab_size: int) -> tuple[RunData, Any]:
    """(the run's data, the objective prepared for its tokenizer): prepared shards, or a corpus split into
    training and validation documents with a tokenizer trained on the training part."""
    if cfg.data:  # prepared shards (`lmkit data prepare`): memory-mapped, each rank reads its rows
        tokenizer, stream, val = open_prepared(cfg.data, cfg.seq_len)
        content = prepared_fingerprint(cfg.data)
    else:
        mixture = parse_mixture(cfg.corpus)
        sources = [load_corpus(s.spec) for s in mixture] if mixture else [load_corpus(cfg.corpus)]
        splits = [c.split(cfg.val_fraction) for c in sources]
        corpus = Corpus("+".join(c.name for c in sources), [d for c in sources for d in c.documents])
        content = corpus.fingerprint() + ("".join(f":{s.spec}={s.weight!r}" for s in mixture) if mixture else "")
        train = Corpus(corpus.name, [d for t, _ in splits for d in t.documents])
        val_corpus = Corpus(corpus.name, [d for _, v in splits for d in v.documents])
        tokenizer = corpus_tokenizer(train, cfg.vocab_size or vocab_size)
    identity = {"tokenizer_sha256": tokenizer_sha(tokenizer), "content_sha256": content}
    if hasattr(objective, "prepare"):  # objectives that need tokens of their own (mlm: <|mask|>)
        objective = objective.prepare(tokenizer, **({"noise": cfg.noise} if cfg.noise is not None else {}))
    bos_id, pad_id = special_ids(tokenizer)
    if not cfg.data:
        if mixture:
            stream = MixedStream([PackedStream(tokenize_corpus(t, tokenizer), bos_id, cfg.seq_len) for t, _ in splits],
                                 mixture)
        else:
            stream = PackedStream(tokenize_corpus(train, tokenizer), bos_id, cfg.seq_len)
        val = tokenize_corpus(val_corpus, tokenizer)
    val_rows, val_mask, val_bytes = eval_rows(val, bos_id, pad_id, cfg.seq_len)
    return RunData(tokenizer, stream, bos_id, pad_id, val_rows, val_mask, val_bytes, identity), objective


def run_model_config(base: ModelConfig, cfg: TrainConfig, objective, data: RunData) -> ModelConfig:
    """`base` with the run's vocabulary, special ids and context."""
    ids = dict(bos_token_id=data.bos_id, eos_token_id=data.bos_id, pad_token_id=data.pad_id, max_seq_len=cfg.seq_len)
    if base.architecture == "encoder-decoder":
        ids.update(seq2seq_run_settings(base, objective.name, data.bos_id, data.pad_id, cfg.seq_len))
    if getattr(objective, "head", None):  # mlm-nsp trains BERT's pre-training head (MLM + NSP)
        ids["task"] = dataclasses.replace(base.task, head=objective.head)
    return base.replace(vocab_size=vocab_size_of(data.tokenizer), **ids)
