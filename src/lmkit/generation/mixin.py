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

from lmkit.errors import GenerationError
from lmkit.generation.logits import block_eos, changes_scores, check_supported, process, processor_options
from lmkit.nn import build_attention_bias


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


def _as_list(value) -> list[int]:
    if value is None:
        return []
    return [int(v) for v in value] if isinstance(value, (list, tuple)) else [int(value)]


class GenerationMixin:
    """Decoding loops shared by every family; the model supplies start, step and reorder."""

    # --- what a decoder-only model does (encoder-decoder models override these three) ----------
    def _generation_start(self, input_ids: torch.Tensor, attention_mask: torch.Tensor | None,
                          **model_kwargs) -> tuple[torch.Tensor, DecodingState]:
        """(sequences the output starts from, state); the first step consumes all of `sequences`."""
        from lmkit.nn import KVCache

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
                 max_new_tokens: int | None = None, do_sample: bool | None = None, num_beams: int | None = None,
                 temperature: float | None = None, top_k: int | None = None, top_p: float | None = None,
                 length_penalty: float | None = None, eos_token_id: int | list[int] | None = None,
                 pad_token_id: int | None = None, repetition_penalty: float | None = None,
                 no_repeat_ngram_size: int | None = None, early_stopping: bool | str | None = None,
                 min_new_tokens: int | None = None, stop_strings: str | list[str] | None = None,
                 tokenizer=None, streamer=None, forced_bos_token_id: int | None = None,
                 forced_eos_token_id: int | list[int] | None = None, num_return_sequences: int | None = None,
                 max_length: int | None = None, min_length: int | None = None, min_p: float | None = None,
                 typical_p: float | None = None, epsilon_cutoff: float | None = None, eta_cutoff: float | None = None,
                 sequence_bias=None, bad_words_ids: list[list[int]] | None = None,
                 suppress_tokens: list[int] | None = None, begin_suppress_tokens: list[int] | None = None,
                 return_dict_in_generate: bool | None = None, output_scores: bool | None = None,
                 output_logits: bool | None = None, encoder_no_repeat_ngram_size: int | None = None,
                 **model_kwargs) -> "torch.Tensor | GenerateOutput":
        """Continue each row of `input_ids`; see transformers' `generate` for every argument.

        An argument left unset takes the loaded folder's generation_config.json value, else transformers'
        default (max_new_tokens: up to generation_config.json's max_length in all, else 20, within the
        model's positions). max_length and min_length count the prompt (for encoder-decoders, the decoder's
        start token and decoder_input_ids), and max_new_tokens / min_new_tokens, even when smaller, win over them,
        as in transformers. With num_return_sequences = n, rows i*n .. i*n + n - 1 of the output
        continue prompt i: n samples, or the n best beams (best first)."""
        defaults = getattr(self, "generation_defaults", {})  # a loaded folder's generation_config.json
        check_supported(defaults)

        def setting(name: str, value, fallback):
            return value if value is not None else defaults.get(name, fallback)

        max_new_tokens = setting("max_new_tokens", max_new_tokens, None)
        do_sample, num_beams = setting("do_sample", do_sample, False), setting("num_beams", num_beams, 1)
        temperature, top_k, top_p = setting("temperature", temperature, 1.0), setting("top_k", top_k, None), \
            setting("top_p", top_p, None)
        length_penalty, early_stopping = setting("length_penalty", length_penalty, 1.0), \
            setting("early_stopping", early_stopping, False)
        repetition_penalty = setting("repetition_penalty", repetition_penalty, 1.0)
        no_repeat_ngram_size = setting("no_repeat_ngram_size", no_repeat_ngram_size, 0)
        encoder_no_repeat_ngram_size = setting("encoder_no_repeat_ngram_size", encoder_no_repeat_ngram_size, 0)
        min_new_tokens = setting("min_new_tokens", min_new_tokens, None)
        num_return_sequences = setting("num_return_sequences", num_return_sequences, 1)
        if input_ids.dim() == 1:
            input_ids = input_ids[None]
        start = self._prompt_length(input_ids, model_kwargs)
        if max_new_tokens is not None and max_new_tokens <= 0:  # transformers' GenerationConfig.validate refuses 0
            raise GenerationError(f"max_new_tokens must be >= 1, got {max_new_tokens}")
        if max_new_tokens is None:
            max_new_tokens = self._default_new_tokens(start, setting("max_length", max_length, None))
        if min_new_tokens is None:  # min_length, a total length: as many new tokens as the prompt leaves short of it
            min_new_tokens = max(setting("min_length", min_length, 0) - start, 0)
        if early_stopping not in (True, False, "never"):
            raise GenerationError(f"early_stopping must be True, False or 'never', got {early_stopping!r}")
        if num_return_sequences < 1:
            raise GenerationError(f"num_return_sequences must be >= 1, got {num_return_sequences}")
        if num_return_sequences > 1 and num_beams == 1 and not do_sample:
            raise GenerationError(f"greedy decoding returns one sequence per prompt, not {num_return_sequences}; "
                                  f"sample (do_sample=True) or use num_beams >= {num_return_sequences}")
        if num_beams > 1 and setting("return_dict_in_generate", return_dict_in_generate, False):
            raise GenerationError("return_dict_in_generate is not supported with beam search (num_beams > 1); "
                                  "leave it unset to get the sequences as one tensor")
        if num_beams > 1 and num_return_sequences > num_beams:
            raise GenerationError(f"num_return_sequences ({num_return_sequences}) must be at most num_beams "
                                  f"({num_beams})")
        if do_sample and not 0 < temperature < float("inf"):  # NaN too: it would fail deep inside sampling
            raise GenerationError(f"temperature must be a finite number > 0 when sampling, got {temperature}; "
                                  "use do_sample=False for greedy")
        if top_p is not None and not 0 < top_p <= 1:
            raise GenerationError(f"top_p must lie in (0, 1], got {top_p}")
        if num_beams < 1:
            raise GenerationError(f"num_beams must be >= 1, got {num_beams}")
        if streamer is not None and num_beams > 1:
            raise GenerationError("a streamer cannot follow beam search (as in transformers); use num_beams=1")
        if top_k is not None and top_k < 0:
            raise GenerationError(f"top_k must be >= 0 (0 turns it off), got {top_k}")
        if not repetition_penalty > 0:
            raise GenerationError(f"repetition_penalty must be > 0 (1.0 turns it off), got {repetition_penalty}")
        if input_ids.shape[-1] == 0:
            raise GenerationError("the prompt is empty; give at least one token (for a model trained here, its BOS token)")
        self._check_context(input_ids, max_new_tokens)
        eos_setting = next((v for v in (eos_token_id, defaults.get("eos_token_id"), self.config.eos_token_id)
                            if v is not None), None)
        eos = _as_list(eos_setting)
        if pad_token_id is None:
            pad_token_id = next((v for v in (defaults.get("pad_token_id"), self.config.pad_token_id) if v is not None),
                                None)
        if attention_mask is None and self.config.architecture == "decoder" and pad_token_id is not None \
                and pad_token_id not in eos and bool((input_ids == pad_token_id).any()):
            attention_mask = (input_ids != pad_token_id).long()  # as transformers infers it: pads are padding
        if pad_token_id is None:
            pad_token_id = eos[0] if eos else 0
        if forced_bos_token_id is None:
            forced_bos_token_id = defaults.get("forced_bos_token_id")
        if forced_eos_token_id is None:
            forced_eos_token_id = defaults.get("forced_eos_token_id")
        prompt_padding = None  # the repetition penalty skips each row's left padding, as transformers' does
        if repetition_penalty != 1.0 and attention_mask is not None and self.config.architecture == "decoder":
            prompt_padding = (attention_mask.reshape(input_ids.shape) != 0).int().argmax(dim=1)
        options = dict(do_sample=do_sample, temperature=temperature, top_k=50 if top_k is None else top_k,
                       top_p=top_p, repetition=repetition_penalty, no_repeat_ngram_size=no_repeat_ngram_size,
                       prompt_padding=prompt_padding)
        forced = (forced_bos_token_id, _as_list(forced_eos_token_id))
        options.update(processor_options(
            self.config.vocab_size, eos, forced=forced, prompts=input_ids, no_repeat_ngram_size=no_repeat_ngram_size,
            encoder_no_repeat_ngram_size=encoder_no_repeat_ngram_size, min_p=setting("min_p", min_p, None),
            typical_p=setting("typical_p", typical_p, None), epsilon_cutoff=setting("epsilon_cutoff", epsilon_cutoff, None),
            eta_cutoff=setting("eta_cutoff", eta_cutoff, None), sequence_bias=setting("sequence_bias", sequence_bias, None),
            bad_words_ids=setting("bad_words_ids", bad_words_ids, None),
            suppress_tokens=setting("suppress_tokens", suppress_tokens, None),
            begin_suppress_tokens=setting("begin_suppress_tokens", begin_suppress_tokens, None)))
        if do_sample and num_beams > 1:  # beam sampling keeps a non-EOS token to explore, as transformers does
            options["keep"] = len(eos) + 1 if eos_setting is not None else 2
        stop_strings = setting("stop_strings", stop_strings, None)
        stops = [stop_strings] if isinstance(stop_strings, str) else list(stop_strings or [])
        if stops and tokenizer is None:
            raise GenerationError("stop_strings needs the tokenizer: pass tokenizer=... to generate")
        if stops and num_beams > 1:  # beam search would otherwise decode on past them
            raise GenerationError("stop_strings are not supported with beam search (num_beams > 1); use "
                                  "eos_token_id, or num_beams=1")
        was_training = self.training
        self.eval()
        try:
            if num_beams > 1:
                from lmkit.generation.beam import beam_search

                return beam_search(self, input_ids, attention_mask, max_new_tokens=max_new_tokens, num_beams=num_beams,
                                   length_penalty=length_penalty, early_stopping=early_stopping, eos=eos,
                                   pad_token_id=pad_token_id, min_new_tokens=min_new_tokens, options=options,
                                   forced=forced, num_return_sequences=num_return_sequences, **model_kwargs)
            if num_return_sequences > 1:  # n samples of each prompt: its row repeated n times, as transformers does
                n, rows = num_return_sequences, input_ids.shape[0]
                input_ids = input_ids.repeat_interleave(n, dim=0)
                attention_mask = None if attention_mask is None else attention_mask.repeat_interleave(n, dim=0)
                if prompt_padding is not None:
                    options["prompt_padding"] = prompt_padding.repeat_interleave(n)
                model_kwargs = {k: v.repeat_interleave(n, dim=0) if torch.is_tensor(v) and v.dim() and v.shape[0] == rows
                                else v for k, v in model_kwargs.items()}
            record = None
            if setting("return_dict_in_generate", return_dict_in_generate, False):
                record = GenerateOutput(scores=() if setting("output_scores", output_scores, False) else None,
                                        logits=() if setting("output_logits", output_logits, False) else None)
            sequences = self._sample(input_ids, attention_mask, max_new_tokens, eos, pad_token_id, min_new_tokens,
                                     options, stops, tokenizer, streamer, forced=forced, record=record, **model_kwargs)
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

    def _sample(self, input_ids, attention_mask, max_new_tokens, eos, pad_token_id, min_new_tokens, options, stops,
                tokenizer, streamer, forced=(None, []), record: "GenerateOutput | None" = None,
                **model_kwargs) -> torch.Tensor:
        """Greedy decoding, or sampling from the processed distribution when options['do_sample'];
        `record` collects each step's raw logits and processed scores where asked."""
        sequences, state = self._generation_start(input_ids, attention_mask, **model_kwargs)
        batch, start = sequences.shape
        if streamer is not None:
            streamer.put(sequences.cpu())
        # the output is written in place into one buffer instead of a torch.cat per step
        out = sequences.new_full((batch, start + max_new_tokens), pad_token_id)
        out[:, :start] = sequences
        length = start
        unfinished = torch.ones(batch, dtype=torch.bool, device=sequences.device)
        eos_tensor = torch.tensor(eos, device=sequences.device) if eos else None
        pad = torch.tensor(pad_token_id, device=sequences.device, dtype=sequences.dtype)
        track = eos_tensor is not None or bool(stops)  # else every row runs to max_new_tokens
        processing = changes_scores(options, forced)
        tokens = sequences
        for step in range(max_new_tokens):
            scores = self._generation_logits(state, tokens)
            if scores.dtype != torch.float32:
                scores = scores.float()
            if record is not None and record.logits is not None:
                record.logits += (scores.clone(),)
            if step < min_new_tokens:
                block_eos(scores, eos)
            if processing:
                scores = process(out[:, :length], scores, start=start, max_length=start + max_new_tokens, forced=forced,
                                 **options)
            if record is not None and record.scores is not None:
                record.scores += (scores,)
            if options["do_sample"]:
                next_tokens = torch.multinomial(scores.softmax(-1), num_samples=1).squeeze(1)
            else:
                next_tokens = scores.argmax(-1)
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
                    text = tokenizer.decode(out[row, start:length].tolist())
                    if any(s in text for s in stops):
                        unfinished[row] = False
            if track and not bool(unfinished.any()):
                break
        if streamer is not None:
            streamer.end()
        return out[:, :length].contiguous()
