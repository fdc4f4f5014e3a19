"""From a `GenerationConfig` to what the decoding loops read (`Decoding`), and the one sampling step they share.

`decoding_for` fills what depends on the model and the prompt (lengths, EOS and padding ids, the processors'
tables) as transformers' generate fills them; `next_scores` and `pick` are the per-step core that `generate`'s loop
and the serving engine both call, so a request decodes the same tokens wherever it runs.
"""
from __future__ import annotations

from dataclasses import dataclass

import torch

from lmkit.errors import GenerationError
from lmkit.generation.config import GenerationConfig
from lmkit.generation.logits import block_eos, changes_scores, check_supported, process, processor_options


def as_id_list(value) -> list[int]:
    if value is None:
        return []
    return [int(v) for v in value] if isinstance(value, (list, tuple)) else [int(v) for v in [value]]


@dataclass
class Decoding:
    """A resolved config and what the loops derive from it for one batch of prompts."""

    config: GenerationConfig
    max_new_tokens: int
    min_new_tokens: int
    eos: list[int]
    eos_set: bool  # an EOS id was given somewhere (beam sampling keeps one more token then)
    pad_token_id: int
    attention_mask: torch.Tensor | None
    options: dict  # `process` keywords
    forced: tuple  # (forced BOS id or None, forced EOS ids)
    stops: list[str]

    @property
    def processing(self) -> bool:
        return changes_scores(self.options, self.forced)


def split_settings(kwargs: dict) -> tuple[dict, dict]:
    """(generation settings, the model's own keyword arguments) of generate's keyword arguments."""
    names = set(GenerationConfig.field_names())
    return {k: v for k, v in kwargs.items() if k in names}, {k: v for k, v in kwargs.items() if k not in names}


def decoding_for(model, input_ids: torch.Tensor, attention_mask: torch.Tensor | None, config: GenerationConfig,
                 start: int) -> Decoding:
    """Resolve `config` against the model's folder defaults for these prompts (`start`: the length the output
    starts from, which max_length and min_length count)."""
    defaults = getattr(model, "generation_defaults", {})  # a loaded folder's generation_config.json
    check_supported(defaults)
    cfg = config.resolved(defaults)
    max_new_tokens = cfg.max_new_tokens
    if max_new_tokens is None:
        max_new_tokens = model._default_new_tokens(start, cfg.max_length)
    min_new_tokens = cfg.min_new_tokens
    if min_new_tokens is None:  # min_length, a total length: as many new tokens as the prompt leaves short of it
        min_new_tokens = max(cfg.min_length - start, 0)
    if input_ids.shape[-1] == 0:
        raise GenerationError("the prompt is empty; give at least one token (for a model trained here, its BOS token)")
    model._check_context(input_ids, max_new_tokens)
    eos_setting = next((v for v in (cfg.eos_token_id, model.config.eos_token_id) if v is not None), None)
    eos = as_id_list(eos_setting)
    pad_token_id = next((v for v in (cfg.pad_token_id, model.config.pad_token_id) if v is not None), None)
    if attention_mask is None and model.config.architecture == "decoder" and pad_token_id is not None \
            and pad_token_id not in eos and bool((input_ids == pad_token_id).any()):
        attention_mask = (input_ids != pad_token_id).long()  # as transformers infers it: pads are padding
    if pad_token_id is None:
        pad_token_id = eos[0] if eos else 0
    prompt_padding = None  # the repetition penalty skips each row's left padding, as transformers' does
    if cfg.repetition_penalty != 1.0 and attention_mask is not None and model.config.architecture == "decoder":
        prompt_padding = (attention_mask.reshape(input_ids.shape) != 0).int().argmax(dim=1)
    options = dict(do_sample=cfg.do_sample, temperature=cfg.temperature, top_k=50 if cfg.top_k is None else cfg.top_k,
                   top_p=cfg.top_p, repetition=cfg.repetition_penalty, no_repeat_ngram_size=cfg.no_repeat_ngram_size,
                   prompt_padding=prompt_padding)
    forced = (cfg.forced_bos_token_id, as_id_list(cfg.forced_eos_token_id))
    options.update(processor_options(
        model.config.vocab_size, eos, forced=forced, prompts=input_ids, no_repeat_ngram_size=cfg.no_repeat_ngram_size,
        encoder_no_repeat_ngram_size=cfg.encoder_no_repeat_ngram_size, min_p=cfg.min_p, typical_p=cfg.typical_p,
        epsilon_cutoff=cfg.epsilon_cutoff, eta_cutoff=cfg.eta_cutoff, sequence_bias=cfg.sequence_bias,
        bad_words_ids=cfg.bad_words_ids, suppress_tokens=cfg.suppress_tokens,
        begin_suppress_tokens=cfg.begin_suppress_tokens))
    if cfg.do_sample and cfg.num_beams > 1:  # beam sampling keeps a non-EOS token to explore, as transformers does
        options["keep"] = len(eos) + 1 if eos_setting is not None else 2
    return Decoding(cfg, max_new_tokens, min_new_tokens, eos, eos_setting is not None, pad_token_id, attention_mask,
                    options, forced, cfg.stops)


def next_scores(sequences: torch.Tensor, scores: torch.Tensor, step: int, start: int, decoding: Decoding) -> torch.Tensor:
    """The processed float32 scores of step `step` (0 = the first new token) after `sequences` (B, start + step)."""
    if scores.dtype != torch.float32:
        scores = scores.float()
    if step < decoding.min_new_tokens:
        block_eos(scores, decoding.eos)
    if decoding.processing:
        scores = process(sequences, scores, start=start, max_length=start + decoding.max_new_tokens,
                         forced=decoding.forced, **decoding.options)
    return scores


def pick(scores: torch.Tensor, do_sample: bool, generator: torch.Generator | None = None) -> torch.Tensor:
    """The next token of each row: a draw from softmax(scores) (torch's global generator unless one is given),
    else the argmax."""
    if do_sample:
        return torch.multinomial(scores.softmax(-1), num_samples=1, generator=generator).squeeze(1)
    return scores.argmax(-1)


def stop_reached(tokenizer, new_ids: list[int], stops: list[str]) -> bool:
    """Whether the text of the new tokens holds one of the stop strings (transformers' StopStringCriteria)."""
    text = tokenizer.decode(new_ids)
    return any(s in text for s in stops)
