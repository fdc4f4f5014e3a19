"""`model.generate`: greedy decoding, sampling and beam search over a KV cache.

Arguments mean what transformers' `generate` makes them mean: top_k defaults to 50 when sampling
(top_k=0 turns it off), pad_token_id defaults to eos_token_id, finished rows are padded, and a
decoder-only model returns prompt + continuation with left-padded prompts positioned as if alone.
Arguments left unset (token ids, sampling and beam settings) come from the loaded folder's generation_config.json.
The loops here call the model only through its `DecodingInterface` and score each step through `step.py`.
"""
from __future__ import annotations

from dataclasses import dataclass

import torch

from lmkit.device import module_device
from lmkit.errors import GenerationError
from lmkit.generation.beam import beam_search
from lmkit.generation.config import GenerationConfig
from lmkit.generation.interface import DecodingInterface
from lmkit.generation.prompt_lookup import lookup_greedy, speculates
from lmkit.generation.step import Decoding, decoding_for, next_scores, pick, split_settings
from lmkit.generation.stopping import StopCriterion, StopStrings


@dataclass
class GenerateOutput:
    """generate's result with return_dict_in_generate, as transformers names it: the sequences, and per step
    (B, V) float32 the processed scores (output_scores) and the raw logits (output_logits)."""

    sequences: torch.Tensor | None = None
    scores: tuple[torch.Tensor, ...] | None = None
    logits: tuple[torch.Tensor, ...] | None = None

    def __getitem__(self, key: str):
        return getattr(self, key)


class GenerationMixin(DecodingInterface):
    """`generate` for every family: its loops call the model's `DecodingInterface` hooks only."""

    # --- the public entry point ----------------------------------------------------------------
    @torch.inference_mode()
    def generate(self, input_ids: torch.Tensor, attention_mask: torch.Tensor | None = None,
                 generation_config: GenerationConfig | None = None, tokenizer=None, streamer=None,
                 stopping_criteria: list[StopCriterion] | None = None, grammar=None,
                 **kwargs) -> "torch.Tensor | GenerateOutput":
        """Continue each row of `input_ids`; the settings are `generation_config` with any GenerationConfig field
        given as a keyword argument written over it, and mean what transformers' `generate` makes them mean.

        A setting left unset takes the loaded folder's generation_config.json value, else transformers'
        default (max_new_tokens: up to generation_config.json's max_length in all, else 20, within the
        model's positions). max_length and min_length count the prompt (for encoder-decoders, the decoder's
        start token and decoder_input_ids), and max_new_tokens / min_new_tokens, even when smaller, win over them,
        as in transformers. With num_return_sequences = n, rows i*n .. i*n + n - 1 of the output
        continue prompt i: n samples, or the n best beams (best first). Other keyword arguments go to the model
        (an encoder-decoder's decoder_input_ids, for one). `stopping_criteria` are lmkit's `StopCriterion`s
        (generation/stopping.py), checked beside eos_token_id and stop_strings. `grammar` (a `generation.grammar.Grammar`
        or {"json_schema" | "json_object" | "regex" | "choice" | "grammar": value}, with tokenizer=) constrains every
        row's new tokens to it, as vLLM's structured outputs do; a row ends at an end token once it is complete."""
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
        start = self.generation_prompt_length(input_ids, model_kwargs)
        decoding = decoding_for(self, input_ids, attention_mask, config, start)
        cfg, attention_mask = decoding.config, decoding.attention_mask
        criteria = list(stopping_criteria or [])
        if streamer is not None and cfg.num_beams > 1:
            raise GenerationError("a streamer cannot follow beam search (as in transformers); use num_beams=1")
        if decoding.stops and tokenizer is None:
            raise GenerationError("stop_strings needs the tokenizer: pass tokenizer=... to generate")
        if (decoding.stops or criteria) and cfg.num_beams > 1:  # beam search would otherwise decode on past them
            raise GenerationError("stop_strings (and stopping_criteria) are not supported with beam search "
                                  "(num_beams > 1); use eos_token_id, or num_beams=1")
        if decoding.stops:
            criteria.append(StopStrings(tokenizer, decoding.stops, start))
        if grammar is not None:
            _constrain(self, decoding, grammar, tokenizer, input_ids.shape[0], start)
        was_training = self.training
        self.eval()
        try:
            if cfg.num_beams > 1:
                return beam_search(self, input_ids, decoding, **model_kwargs)
            if cfg.num_return_sequences > 1:  # n samples of each prompt: its row repeated n times, as transformers does
                n, rows = cfg.num_return_sequences, input_ids.shape[0]
                input_ids = input_ids.repeat_interleave(n, dim=0)
                decoding = decoding.rows(torch.arange(rows, device=input_ids.device).repeat_interleave(n))
                model_kwargs = {k: v.repeat_interleave(n, dim=0) if torch.is_tensor(v) and v.dim() and v.shape[0] == rows
                                else v for k, v in model_kwargs.items()}
            if cfg.prompt_lookup_num_tokens and not cfg.return_dict_in_generate and speculates(self.config) \
                    and (streamer is None or input_ids.shape[0] == 1):
                return lookup_greedy(self, input_ids, decoding, criteria, streamer, cfg.prompt_lookup_num_tokens,
                                     cfg.max_matching_ngram_size or 2, **model_kwargs)
            record = None
            if cfg.return_dict_in_generate:
                record = GenerateOutput(scores=() if cfg.output_scores else None,
                                        logits=() if cfg.output_logits else None)
            sequences = self._sample(input_ids, decoding, criteria, streamer, record=record, **model_kwargs)
            if record is None:
                return sequences
            record.sequences = sequences
            return record
        finally:
            self.train(was_training)

    def _sample(self, input_ids, decoding: Decoding, criteria: list[StopCriterion], streamer,
                record: "GenerateOutput | None" = None, **model_kwargs) -> torch.Tensor:
        """Greedy decoding, or sampling from the processed distribution when do_sample, until every row has
        stopped (`stopping.py`'s rules); `record` collects each step's raw logits and processed scores where asked."""
        sequences, state = self.prepare_generation(input_ids, decoding.attention_mask, **model_kwargs)
        batch, start = sequences.shape
        max_new_tokens, eos = decoding.max_new_tokens, decoding.eos
        own = [c for c in criteria if not c.whole_batch]
        whole = [c for c in criteria if c.whole_batch]
        if streamer is not None:
            streamer.put(sequences.cpu())
        # the output is written in place into one buffer instead of a torch.cat per step
        out = sequences.new_full((batch, start + max_new_tokens), decoding.pad_token_id)
        out[:, :start] = sequences
        length = start
        unfinished = torch.ones(batch, dtype=torch.bool, device=sequences.device)
        done = [False] * batch  # rows that met a whole-batch criterion
        eos_tensor = torch.tensor(eos, device=sequences.device) if eos else None
        pad = torch.tensor(decoding.pad_token_id, device=sequences.device, dtype=sequences.dtype)
        track = eos_tensor is not None or bool(criteria)  # else every row runs to max_new_tokens
        tokens = sequences
        for _ in range(max_new_tokens):
            scores = self.generation_logits(state, tokens)
            if record is not None and record.logits is not None:
                record.logits += (scores.float().clone(),)
            scores = next_scores(out[:, :length], scores, decoding)
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
            for row in range(batch):
                if own and bool(unfinished[row]) and any(c.done(out[row, :length]) for c in own):
                    unfinished[row] = False
                if whole and not done[row]:
                    done[row] = any(c.done(out[row, :length]) for c in whole)
            if whole and all(done):
                break
            if track and not bool(unfinished.any()):
                break
        if streamer is not None:
            streamer.end()
        return out[:, :length].contiguous()


def _constrain(model, decoding: Decoding, grammar, tokenizer, rows: int, start: int) -> None:
    """Put the grammar's mask first in the processor list (before penalties and sampling filters, as vLLM does)."""
    from lmkit.generation.grammar import GrammarConstraint

    if tokenizer is None:
        raise GenerationError("grammar needs the tokenizer: pass tokenizer=... to generate")
    if decoding.config.num_beams > 1 or decoding.config.prompt_lookup_num_tokens \
            or model.config.architecture != "decoder":  # drafts and beams would feed a row's matcher tokens it drops
        raise GenerationError("grammar constrains sampling and greedy decoding of decoder-only models; use "
                              "num_beams=1 without prompt_lookup_num_tokens")
    decoding.processors.insert(0, GrammarConstraint.build(tokenizer, model.config.vocab_size, grammar, rows, start,
                                                          decoding.eos))
