"""`model.generate`: greedy decoding, sampling and beam search over a KV cache.

Arguments mean what transformers' `generate` makes them mean: top_k defaults to 50 when sampling
(top_k=0 turns it off), pad_token_id defaults to eos_token_id, finished rows are padded, and a
decoder-only model returns prompt + continuation with left-padded prompts positioned as if alone.
Arguments left unset (token ids, sampling and beam settings) come from the loaded folder's generation_config.json.
"""
from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

import torch

from lmkit.device import module_device
from lmkit.errors import GenerationError
from lmkit.generation.config import GenerationConfig
from lmkit.generation.prompt_lookup import lookup_greedy, speculates
from lmkit.generation.settings import Decoding, decoding_for, next_scores, pick, split_settings, stop_reached
from lmkit.nn import KVCache, build_attention_bias


@dataclass
class DecodingState:
    """What a model carries from one decoding step to the next."""

    cache: Any
    attention_mask: torch.Tensor | None = None
    extra: dict[str, Any] = field(default_factory=dict)


@dataclass
class GenerateOutput:
    """generate's result with return_dict_in_generate, as transformers names it: the sequences, and per step
    (B, V) float32 the processed scores (output_scores) and the raw logits (output_logits)."""

    sequences: torch.Tensor | None = None
    scores: tuple[torch.Tensor, ...] | None = None
    logits: tuple[torch.Tensor, ...] | None = None

    def __getitem__(self, key: str):
        return getattr(self, key)


class GenerationMixin:
    """Decoding loops shared by every family; the model supplies start, step and reorder."""

    # --- what a decoder-only model does (encoder-decoder models override these three) ----------
    def _generation_start(self, input_ids: torch.Tensor, attention_mask: torch.Tensor | None,
                          **model_kwargs) -> tuple[torch.Tensor, DecodingState]:
        """(sequences the output starts from, state); the first step consumes all of `sequences`."""

        if model_kwargs:
            raise GenerationError(f"generate() got arguments it does not know: {', '.join(sorted(model_kwargs))}")
        if attention_mask is None:
            attention_mask = torch.ones_like(input_ids)
        return input_ids, DecodingState(cache=KVCache(), attention_mask=attention_mask)

    def _decode_plan(self, batch: int):
        """A lean one-token step for `batch` rows (a `DecodePlan`), or None to decode through forward."""
        return None

    def _generation_logits(self, state: DecodingState, tokens: torch.Tensor) -> torch.Tensor:
        """Next-token logits (B, V) after feeding `tokens` (B, t), updating the cache and mask.

        Without padding the model's defaults (positions past..past+t-1, a causal mask SDPA builds
        itself) are exact, so each step passes neither mask nor positions: the lean path.
        """
        past = state.cache.get_seq_length()
        mask = state.attention_mask
        padded = state.extra.get("padded")
        if padded is None:
            padded = state.extra["padded"] = mask is not None and not bool(mask.all())
        plan = None
        if past and tokens.shape[1] == 1:
            plan = state.extra.get("plan", False)
            if plan is False:
                plan = state.extra["plan"] = self._decode_plan(tokens.shape[0])
        if not padded:
            if plan is not None:
                return plan.step(tokens, state.cache, tokens.new_full(tokens.shape, past), None)
            out = self(tokens, past_key_values=state.cache, use_cache=True, logits_to_keep=1)
            return out.logits[:, -1]
        if past:  # as transformers 5: new tokens go on from the last position (the prompt's, if it ends padded)
            mask = torch.cat([mask, mask.new_ones(mask.shape[0], tokens.shape[1])], dim=1)
            state.attention_mask = mask
            positions = state.extra["position"] + 1 + torch.arange(tokens.shape[1], device=tokens.device)
        else:  # the prompt: each real token's index among the real ones, padding at 0
            positions = (mask.long().cumsum(-1) - 1).masked_fill(mask == 0, 0)
        state.extra["position"] = positions[:, -1:]
        if plan is not None:
            bias, _ = build_attention_bias(mask, tokens.shape[0], 1, past + 1, True, torch.bool, tokens.device)
            return plan.step(tokens, state.cache, positions, bias)
        out = self(tokens, attention_mask=mask, position_ids=positions, past_key_values=state.cache,
                   use_cache=True, logits_to_keep=1)
        return out.logits[:, -1]

    def _generation_reorder(self, state: DecodingState, index: torch.Tensor) -> None:
        state.cache.reorder(index)
        if state.attention_mask is not None:
            state.attention_mask = state.attention_mask.index_select(0, index)
        if "position" in state.extra:
            state.extra["position"] = state.extra["position"].index_select(0, index)

    # --- the public entry point ----------------------------------------------------------------
    @torch.inference_mode()
    def generate(self, input_ids: torch.Tensor, attention_mask: torch.Tensor | None = None,
                 generation_config: GenerationConfig | None = None, tokenizer=None, streamer=None,
                 **kwargs) -> "torch.Tensor | GenerateOutput":
        """Continue each row of `input_ids`; the settings are `generation_config` with any GenerationConfig field
        given as a keyword argument written over it, and mean what transformers' `generate` makes them mean.

        A setting left unset takes the loaded folder's generation_config.json value, else transformers'
        default (max_new_tokens: up to generation_config.json's max_length in all, else 20, within the
        model's positions). max_length and min_length count the prompt (for encoder-decoders, the decoder's
        start token and decoder_input_ids), and max_new_tokens / min_new_tokens, even when smaller, win over them,
        as in transformers. With num_return_sequences = n, rows i*n .. i*n + n - 1 of the output
        continue prompt i: n samples, or the n best beams (best first). Other keyword arguments go to the model
        (an encoder-decoder's decoder_input_ids, for one)."""
        settings, model_kwargs = split_settings(kwargs)
        config = GenerationConfig.build(generation_config, **settings)
        if config.decoder_start_token_id is not None:  # the encoder-decoder's start builds the decoder prompt
            model_kwargs["decoder_start_token_id"] = config.decoder_start_token_id
        if input_ids.dim() == 1:
            input_ids = input_ids[None]
        # the prompt goes where the model is (ids made on the host, a model on a GPU); the output stays there
        device = module_device(self)
        input_ids = input_ids.to(device)
        attention_mask = None if attention_mask is None else attention_mask.to(device)
        model_kwargs = {k: v.to(device) if torch.is_tensor(v) else v for k, v in model_kwargs.items()}
        decoding = decoding_for(self, input_ids, attention_mask, config, self._prompt_length(input_ids, model_kwargs))
        cfg, attention_mask, options = decoding.config, decoding.attention_mask, decoding.options
        if streamer is not None and cfg.num_beams > 1:
            raise GenerationError("a streamer cannot follow beam search (as in transformers); use num_beams=1")
        if decoding.stops and tokenizer is None:
            raise GenerationError("stop_strings needs the tokenizer: pass tokenizer=... to generate")
        if decoding.stops and cfg.num_beams > 1:  # beam search would otherwise decode on past them
            raise GenerationError("stop_strings are not supported with beam search (num_beams > 1); use "
                                  "eos_token_id, or num_beams=1")
        was_training = self.training
        self.eval()
        try:
            if cfg.num_beams > 1:
                from lmkit.generation.beam import beam_search

                return beam_search(self, input_ids, attention_mask, max_new_tokens=decoding.max_new_tokens,
                                   num_beams=cfg.num_beams, length_penalty=cfg.length_penalty,
                                   early_stopping=cfg.early_stopping, eos=decoding.eos,
                                   pad_token_id=decoding.pad_token_id, min_new_tokens=decoding.min_new_tokens,
                                   options=options, forced=decoding.forced,
                                   num_return_sequences=cfg.num_return_sequences, **model_kwargs)
            if cfg.num_return_sequences > 1:  # n samples of each prompt: its row repeated n times, as transformers does
                n, rows = cfg.num_return_sequences, input_ids.shape[0]
                input_ids = input_ids.repeat_interleave(n, dim=0)
                decoding.attention_mask = None if attention_mask is None else attention_mask.repeat_interleave(n, dim=0)
                if options["prompt_padding"] is not None:
                    options["prompt_padding"] = options["prompt_padding"].repeat_interleave(n)
                model_kwargs = {k: v.repeat_interleave(n, dim=0) if torch.is_tensor(v) and v.dim() and v.shape[0] == rows
                                else v for k, v in model_kwargs.items()}
            if cfg.prompt_lookup_num_tokens and not cfg.return_dict_in_generate and speculates(self.config) \
                    and (streamer is None or input_ids.shape[0] == 1):
                return lookup_greedy(self, input_ids, decoding, tokenizer, streamer, cfg.prompt_lookup_num_tokens,
                                     cfg.max_matching_ngram_size or 2, **model_kwargs)
            record = None
            if cfg.return_dict_in_generate:
                record = GenerateOutput(scores=() if cfg.output_scores else None,
                                        logits=() if cfg.output_logits else None)
            sequences = self._sample(input_ids, decoding, tokenizer, streamer, record=record, **model_kwargs)
            if record is None:
                return sequences
            record.sequences = sequences
            return record
        finally:
            self.train(was_training)

    def _prompt_length(self, input_ids: torch.Tensor, model_kwargs: dict) -> int:
        """Length of what the output starts from, which max_length and min_length count: the prompt here
        (an encoder-decoder model's decoder prompt instead)."""
        return input_ids.shape[-1]

    def _default_new_tokens(self, start: int, max_length: int | None) -> int:
        """transformers' length when max_new_tokens is unset: max_length tokens in all (the `start` tokens of the
        prompt, or decoder prompt, included), else 20 new ones, capped at max_position_embeddings in all where the
        model has positions."""
        if max_length is None:
            max_length = start + 20
            if self.config.architecture == "decoder" or self.config.position == "learned":
                max_length = min(max_length, self.config.max_seq_len)
        if max_length <= start:
            raise GenerationError(f"the prompt has {start} tokens but generation stops at max_length {max_length} "
                                  f"tokens in all; pass max_new_tokens=N (or shorten the prompt)")
        return max_length - start

    def _check_context(self, input_ids: torch.Tensor, max_new_tokens: int) -> None:
        limit = self.config.max_seq_len
        if self.config.architecture != "decoder":
            return
        scaling = self.config.rope_scaling or {}
        dynamic = self.config.position == "rope" and scaling.get("rope_type", scaling.get("type")) == "dynamic"
        if input_ids.shape[1] > limit and not dynamic:  # dynamic NTK RoPE grows its base past the context instead
            raise GenerationError(f"the prompt has {input_ids.shape[1]} tokens but the model's context is {limit}; "
                                  f"shorten the prompt")
        if self.config.position in ("learned", "sinusoidal") and input_ids.shape[1] + max_new_tokens > limit:
            raise GenerationError(f"prompt ({input_ids.shape[1]} tokens) + max_new_tokens ({max_new_tokens}) exceeds the "
                                  f"model's {limit} positions; lower max_new_tokens to {limit - input_ids.shape[1]}")

    def _sample(self, input_ids, decoding: Decoding, tokenizer, streamer, record: "GenerateOutput | None" = None,
                **model_kwargs) -> torch.Tensor:
        """Greedy decoding, or sampling from the processed distribution when do_sample;
        `record` collects each step's raw logits and processed scores where asked."""
        sequences, state = self._generation_start(input_ids, decoding.attention_mask, **model_kwargs)
        batch, start = sequences.shape
        max_new_tokens, eos, stops = decoding.max_new_tokens, decoding.eos, decoding.stops
        if streamer is not None:
            streamer.put(sequences.cpu())
        # the output is written in place into one buffer instead of a torch.cat per step
        out = sequences.new_full((batch, start + max_new_tokens), decoding.pad_token_id)
        out[:, :start] = sequences
        length = start
        unfinished = torch.ones(batch, dtype=torch.bool, device=sequences.device)
        eos_tensor = torch.tensor(eos, device=sequences.device) if eos else None
        pad = torch.tensor(decoding.pad_token_id, device=sequences.device, dtype=sequences.dtype)
        track = eos_tensor is not None or bool(stops)  # else every row runs to max_new_tokens
        tokens = sequences
        for step in range(max_new_tokens):
            scores = self._generation_logits(state, tokens)
            if record is not None and record.logits is not None:
                record.logits += (scores.float().clone(),)
            scores = next_scores(out[:, :length], scores, step, start, decoding)
            if record is not None and record.scores is not None:
                record.scores += (scores,)
            next_tokens = pick(scores, decoding.config.do_sample)
            if track:
                next_tokens = torch.where(unfinished, next_tokens, pad)
            out[:, length] = next_tokens
            length += 1
            tokens = out[:, length - 1:length]
            if streamer is not None:
                streamer.put(next_tokens.cpu())
            if eos_tensor is not None:
                unfinished &= ~torch.isin(next_tokens, eos_tensor)
            if stops:
                for row in range(batch):
                    if stop_reached(tokenizer, out[row, start:length].tolist(), stops):
                        unfinished[row] = False
            if track and not bool(unfinished.any()):
                break
        if streamer is not None:
            streamer.end()
        return out[:, :length].contiguous()
