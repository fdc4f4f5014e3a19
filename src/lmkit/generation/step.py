"""The per-step decoding core: from a `GenerationConfig` to what the decoding loops read (`Decoding`), and the one
step they share (`next_scores`, then `pick`).

`decoding_for` fills what depends on the model and the prompt (lengths, EOS and padding ids, the processor list)
as transformers' generate fills them; `next_scores` and `pick` are the per-step core that `generate`'s loops, prompt
lookup, beam search and the serving engine all call, so a request decodes the same tokens wherever it runs.
"""
from __future__ import annotations

import dataclasses
from dataclasses import dataclass

import torch

from lmkit.errors import GenerationError
from lmkit.generation.config import GenerationConfig
from lmkit.generation.logits import check_supported, id_list
from lmkit.generation.processors import LogitsProcessorList, build_processors


@dataclass
class Decoding:
    """A resolved config and what the loops derive from it for one batch of prompts."""

    config: GenerationConfig
    max_new_tokens: int
    min_new_tokens: int
    eos: list[int]  # a row stops at any of them
    pad_token_id: int
    attention_mask: torch.Tensor | None
    processors: LogitsProcessorList
    stops: list[str]

    def rows(self, index: torch.Tensor) -> "Decoding":
        """This decoding for the rows `index` of its batch (each prompt's samples, or one row alone)."""
        mask = None if self.attention_mask is None else self.attention_mask.index_select(0, index)
        return dataclasses.replace(self, attention_mask=mask, processors=self.processors.select(index))


def split_settings(kwargs: dict) -> tuple[dict, dict]:
    """(generation settings, the model's own keyword arguments) of generate's keyword arguments."""
    names = set(GenerationConfig.field_names())
    return {k: v for k, v in kwargs.items() if k in names}, {k: v for k, v in kwargs.items() if k not in names}


def decoding_for(model, input_ids: torch.Tensor, attention_mask: torch.Tensor | None, config: GenerationConfig,
                 start: int) -> Decoding:
    """Resolve `config` against the model's folder defaults for these prompts (`start`: the length the output
    starts from, which max_length and min_length count); `model` has the `DecodingInterface`."""
    defaults = getattr(model, "generation_defaults", {})  # a loaded folder's generation_config.json
    check_supported(defaults)
    cfg = config.resolved(defaults)
    max_new_tokens = cfg.max_new_tokens
    if max_new_tokens is None:
        max_new_tokens = model.default_new_tokens(start, cfg.max_length)
    min_new_tokens = cfg.min_new_tokens
    if min_new_tokens is None:  # min_length, a total length: as many new tokens as the prompt leaves short of it
        min_new_tokens = max(cfg.min_length - start, 0)
    if input_ids.shape[-1] == 0:
        raise GenerationError("the prompt is empty; give at least one token (for a model trained here, its BOS token)")
    model.check_context(input_ids, max_new_tokens)
    eos_setting = next((v for v in (cfg.eos_token_id, model.config.eos_token_id) if v is not None), None)
    eos = id_list(eos_setting)
    pad_token_id = next((v for v in (cfg.pad_token_id, model.config.pad_token_id) if v is not None), None)
    if attention_mask is None and model.config.architecture == "decoder" and pad_token_id is not None \
            and pad_token_id not in eos and bool((input_ids == pad_token_id).any()):
        attention_mask = (input_ids != pad_token_id).long()  # as transformers infers it: pads are padding
    if pad_token_id is None:
        pad_token_id = eos[0] if eos else 0
    prompt_padding = None  # the repetition penalty skips each row's left padding, as transformers' does
    if cfg.repetition_penalty != 1.0 and attention_mask is not None and model.config.architecture == "decoder":
        prompt_padding = (attention_mask.reshape(input_ids.shape) != 0).int().argmax(dim=1)
    keep = 1
    if cfg.do_sample and cfg.num_beams > 1:  # beam sampling keeps a non-EOS token to explore, as transformers does
        keep = len(eos) + 1 if eos_setting is not None else 2
    processors = build_processors(cfg, model.config.vocab_size, eos, start=start, max_length=start + max_new_tokens,
                                  min_new_tokens=min_new_tokens, prompts=input_ids, prompt_padding=prompt_padding,
                                  keep=keep)
    return Decoding(cfg, max_new_tokens, min_new_tokens, eos, pad_token_id, attention_mask, processors, cfg.stops)


def next_scores(sequences: torch.Tensor | None, scores: torch.Tensor, decoding: Decoding) -> torch.Tensor:
    """The processed float32 scores of the next token after `sequences` (B, T) from the model's `scores` (B, V).
    `sequences` may be None where `decoding.processors.acts_at(T)` is False: nothing reads them then."""
    if scores.dtype != torch.float32:
        scores = scores.float()
    if sequences is not None:
        scores = decoding.processors(sequences, scores)
    return scores


def pick(scores: torch.Tensor, do_sample: bool, generator: torch.Generator | None = None) -> torch.Tensor:
    """The next token of each row: a draw from softmax(scores) (torch's global generator unless one is given),
    else the argmax."""
    if do_sample:
        return torch.multinomial(scores.softmax(-1), num_samples=1, generator=generator).squeeze(1)
    return scores.argmax(-1)
