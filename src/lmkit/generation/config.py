"""`GenerationConfig`: the settings of one `generate` call, their defaults and checks, and the generation_config.json
keys they are read from.

Every field starts unset (None). `resolved(defaults)` fills the unset ones from a folder's generation_config.json,
then from transformers' defaults (`FALLBACKS`); the ones whose default depends on the model or the prompt
(max_new_tokens, min_new_tokens, eos_token_id, pad_token_id, forced ids) stay None for `generate` to fill.
"""
from __future__ import annotations

import dataclasses
import json
from dataclasses import dataclass, fields
from pathlib import Path
from typing import Any

from lmkit.atomic import atomic_write_json
from lmkit.errors import GenerationError
from lmkit.generation.logits import UNSUPPORTED_SETTINGS

# transformers' GenerationConfig defaults for the fields that have one independent of the model
FALLBACKS = {"do_sample": False, "num_beams": 1, "temperature": 1.0, "length_penalty": 1.0, "early_stopping": False,
             "repetition_penalty": 1.0, "no_repeat_ngram_size": 0, "encoder_no_repeat_ngram_size": 0, "min_length": 0,
             "num_return_sequences": 1, "return_dict_in_generate": False, "output_scores": False,
             "output_logits": False}


@dataclass
class GenerationConfig:
    """What transformers' GenerationConfig field of the same name means; None = unset."""

    max_new_tokens: int | None = None
    max_length: int | None = None
    min_new_tokens: int | None = None
    min_length: int | None = None
    do_sample: bool | None = None
    num_beams: int | None = None
    temperature: float | None = None
    top_k: int | None = None
    top_p: float | None = None
    min_p: float | None = None
    typical_p: float | None = None
    epsilon_cutoff: float | None = None
    eta_cutoff: float | None = None
    repetition_penalty: float | None = None
    no_repeat_ngram_size: int | None = None
    encoder_no_repeat_ngram_size: int | None = None
    length_penalty: float | None = None
    early_stopping: bool | str | None = None
    num_return_sequences: int | None = None
    eos_token_id: int | list[int] | None = None
    pad_token_id: int | None = None
    decoder_start_token_id: int | list[int] | None = None
    forced_bos_token_id: int | None = None
    forced_eos_token_id: int | list[int] | None = None
    sequence_bias: Any = None
    bad_words_ids: list[list[int]] | None = None
    suppress_tokens: list[int] | None = None
    begin_suppress_tokens: list[int] | None = None
    stop_strings: str | list[str] | None = None
    return_dict_in_generate: bool | None = None
    output_scores: bool | None = None
    output_logits: bool | None = None
    prompt_lookup_num_tokens: int | None = None
    max_matching_ngram_size: int | None = None

    @classmethod
    def field_names(cls) -> tuple[str, ...]:
        """The settings generate takes as keyword arguments."""
        return tuple(f.name for f in fields(cls))

    @classmethod
    def file_keys(cls) -> tuple[str, ...]:
        """generation_config.json keys lmkit reads: its own fields, and the settings it refuses (so that a folder
        asking for one is refused rather than silently decoded without it)."""
        return (*cls.field_names(), *UNSUPPORTED_SETTINGS)

    @classmethod
    def build(cls, base: "GenerationConfig | None" = None, **settings) -> "GenerationConfig":
        """`base` (or an empty config) with `settings` that are not None written over it."""
        unknown = sorted(set(settings) - set(cls.field_names()))
        if unknown:
            raise GenerationError(f"generate() got arguments it does not know: {', '.join(unknown)}")
        config = dataclasses.replace(base) if base is not None else cls()
        for name, value in settings.items():
            if value is not None:
                setattr(config, name, value)
        return config

    @classmethod
    def from_dict(cls, raw: dict) -> "GenerationConfig":
        """The fields of a generation_config.json dict (other keys are ignored, as transformers keeps them aside)."""
        names = set(cls.field_names())
        return cls(**{k: v for k, v in raw.items() if k in names and v is not None})

    @classmethod
    def from_pretrained(cls, folder: str | Path) -> "GenerationConfig":
        path = Path(folder) / "generation_config.json"
        if not path.is_file():
            raise GenerationError(f"{path} does not exist; save one with GenerationConfig(...).save_pretrained(folder)")
        return cls.from_dict(json.loads(path.read_text(encoding="utf-8")))

    def to_dict(self) -> dict:
        """The set fields only: what a generation_config.json written from this config holds."""
        return {f.name: getattr(self, f.name) for f in fields(self) if getattr(self, f.name) is not None}

    def save_pretrained(self, folder: str | Path) -> None:
        atomic_write_json(Path(folder) / "generation_config.json", self.to_dict())

    def resolved(self, defaults: dict | None = None) -> "GenerationConfig":
        """Unset fields from `defaults` (a folder's generation_config.json), then from FALLBACKS; checked."""
        defaults = defaults or {}
        out = dataclasses.replace(self)
        for name in self.field_names():
            if getattr(out, name) is None:
                setattr(out, name, defaults.get(name, FALLBACKS.get(name)))
        out.validate()
        return out

    def validate(self) -> None:
        """Refuse settings transformers' GenerationConfig.validate (or its decoding) would refuse."""
        if self.max_new_tokens is not None and self.max_new_tokens <= 0:
            raise GenerationError(f"max_new_tokens must be >= 1, got {self.max_new_tokens}")
        if self.early_stopping not in (None, True, False, "never"):
            raise GenerationError(f"early_stopping must be True, False or 'never', got {self.early_stopping!r}")
        beams = 1 if self.num_beams is None else self.num_beams
        returned = 1 if self.num_return_sequences is None else self.num_return_sequences
        if returned < 1:
            raise GenerationError(f"num_return_sequences must be >= 1, got {returned}")
        if beams < 1:
            raise GenerationError(f"num_beams must be >= 1, got {beams}")
        if returned > 1 and beams == 1 and not self.do_sample:
            raise GenerationError(f"greedy decoding returns one sequence per prompt, not {returned}; "
                                  f"sample (do_sample=True) or use num_beams >= {returned}")
        if beams > 1 and self.return_dict_in_generate:
            raise GenerationError("return_dict_in_generate is not supported with beam search (num_beams > 1); "
                                  "leave it unset to get the sequences as one tensor")
        if beams > 1 and returned > beams:
            raise GenerationError(f"num_return_sequences ({returned}) must be at most num_beams ({beams})")
        for name in ("prompt_lookup_num_tokens", "max_matching_ngram_size"):
            value = getattr(self, name)
            if value is not None and (isinstance(value, bool) or not isinstance(value, int) or value < 1):
                raise GenerationError(f"{name} must be a whole number >= 1, got {value!r}")
        if self.prompt_lookup_num_tokens and (beams > 1 or self.do_sample):
            raise GenerationError("prompt_lookup_num_tokens speculates for greedy decoding; leave it unset to sample "
                                  "or to search with beams")
        temperature = 1.0 if self.temperature is None else self.temperature
        if self.do_sample and not 0 < temperature < float("inf"):  # NaN too: it would fail deep inside sampling
            raise GenerationError(f"temperature must be a finite number > 0 when sampling, got {temperature}; "
                                  "use do_sample=False for greedy")
        if self.top_p is not None and not 0 < self.top_p <= 1:
            raise GenerationError(f"top_p must lie in (0, 1], got {self.top_p}")
        if self.top_k is not None and self.top_k < 0:
            raise GenerationError(f"top_k must be >= 0 (0 turns it off), got {self.top_k}")
        if self.repetition_penalty is not None and not self.repetition_penalty > 0:
            raise GenerationError(f"repetition_penalty must be > 0 (1.0 turns it off), got {self.repetition_penalty}")

    @property
    def stops(self) -> list[str]:
        return [self.stop_strings] if isinstance(self.stop_strings, str) else list(self.stop_strings or [])
