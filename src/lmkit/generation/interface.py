"""The models' public decoding interface: what `generate`, beam search, prompt lookup, the serving `Engine` and the
harness call on a model, declared once here with the decoder-only behaviour; an encoder-decoder (`Seq2SeqLM`) or
XLNet overrides the hooks it does differently.

A loop calls `prepare_generation` once (the sequences the output starts from, and a `DecodingState`), then
`generation_logits(state, tokens)` per step (the first step feeds all the start sequences, later ones the new
tokens), `draft_logits` where prompt lookup checks drafted tokens, and `reorder_generation` where rows change
places (beams); `default_new_tokens` and `check_context` resolve and check the lengths first, and `decode_plan`
offers a lean step where the model has one.
"""
from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

import torch

from lmkit.errors import GenerationError
from lmkit.nn import KVCache, build_attention_bias


@dataclass
class DecodingState:
    """What a model carries from one decoding step to the next."""

    cache: Any
    attention_mask: torch.Tensor | None = None
    extra: dict[str, Any] = field(default_factory=dict)


class DecodingInterface:
    """The decoding hooks every family offers (see the module docstring); the defaults are a decoder-only model's."""

    def prepare_generation(self, input_ids: torch.Tensor, attention_mask: torch.Tensor | None,
                           prefill_unpadded: bool = False, **model_kwargs) -> tuple[torch.Tensor, DecodingState]:
        """(sequences the output starts from (B, S), state); the first `generation_logits` consumes all of them.
        prefill_unpadded: read left-padded prompts without their padding (`prefill_unpadded`), as the harness
        does; the same keys at the same positions, so the same tokens up to float rounding."""
        if model_kwargs:
            raise GenerationError(f"generate() got arguments it does not know: {', '.join(sorted(model_kwargs))}")
        if attention_mask is None:
            attention_mask = torch.ones_like(input_ids)
        state = DecodingState(cache=KVCache(), attention_mask=attention_mask)
        if prefill_unpadded:
            state.extra["unpadded"] = True
        return input_ids, state

    def generation_prompt_length(self, input_ids: torch.Tensor, model_kwargs: dict) -> int:
        """Length S of what the output starts from, which max_length and min_length count: the prompt here
        (an encoder-decoder model's decoder prompt instead)."""
        return input_ids.shape[-1]

    def decode_plan(self, batch: int):
        """A lean one-token step for `batch` rows (a `DecodePlan`), or None to decode through forward."""
        return None

    def generation_logits(self, state: DecodingState, tokens: torch.Tensor) -> torch.Tensor:
        """Next-token logits (B, V) after feeding `tokens` (B, t), updating the cache and mask.

        Without padding the model's defaults (positions past..past+t-1, a causal mask SDPA builds
        itself) are exact, so each step passes neither mask nor positions: the lean path. With left padding,
        each real token's position is its index among the row's real tokens, as transformers places it.
        """
        past = state.cache.get_seq_length()
        mask = state.attention_mask
        padded = state.extra.get("padded")
        if padded is None:
            padded = state.extra["padded"] = mask is not None and not bool(mask.all())
        plan = None
        if past and tokens.shape[1] == 1:
            plan = self.state_plan(state, tokens.shape[0])
        if not past and padded and state.extra.get("unpadded"):
            return prefill_unpadded(self, state, tokens)
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

    def draft_logits(self, state: DecodingState, fed: torch.Tensor, used: list[int]) -> torch.Tensor:
        """Prompt lookup's check: logits (B, k, V) after each column of `fed` (B, k), each row's pending last token
        then its draft, the first used[r] columns, then padding (anything). Appends the k columns to the cache
        and the mask (the caller turns rejected ones into holes); a left-padded decoder-only state only."""
        k = fed.shape[1]
        mask = torch.cat([state.attention_mask, state.attention_mask.new_ones(fed.shape[0], k)], dim=1)
        # a short draft's padding columns become holes; they take the first column's position, so that none lies
        # past the positions the real columns reach (a learned table ends)
        steps = torch.arange(k, device=fed.device)[None, :]
        used_t = torch.tensor(used, device=fed.device)[:, None]
        positions = state.extra["position"] + 1 + steps.masked_fill(steps >= used_t, 0)
        plan = self.state_plan(state, fed.shape[0])
        if plan is not None:  # the lean step, k tokens a row, causal among them
            past = state.cache.get_seq_length()
            bias, _ = build_attention_bias(mask, fed.shape[0], k, past + k, True, torch.bool, fed.device)
            logits = plan.step(fed, state.cache, positions, bias)
        else:
            logits = self(fed, attention_mask=mask, position_ids=positions, past_key_values=state.cache,
                          use_cache=True).logits
        state.attention_mask = mask
        return logits

    def state_plan(self, state: DecodingState, batch: int):
        """The `decode_plan` of this decoding, built once and kept in the state."""
        plan = state.extra.get("plan", False)
        if plan is False:
            plan = state.extra["plan"] = self.decode_plan(batch)
        return plan

    def reorder_generation(self, state: DecodingState, index: torch.Tensor) -> None:
        """Make row i of the state what row index[i] was (beam search's parents)."""
        state.cache.reorder(index)
        if state.attention_mask is not None:
            state.attention_mask = state.attention_mask.index_select(0, index)
        if "position" in state.extra:
            state.extra["position"] = state.extra["position"].index_select(0, index)

    def default_new_tokens(self, start: int, max_length: int | None) -> int:
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

    def check_context(self, input_ids: torch.Tensor, max_new_tokens: int) -> None:
        """Refuse a prompt, or prompt + max_new_tokens, that the model's positions cannot hold."""
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


def prefill_unpadded(model, state: DecodingState, ids: torch.Tensor) -> torch.Tensor:
    """Next-token logits (B, V) after left-padded prompts, with the KV cache `state` then decodes from, computed
    without the padding: the prompts of each length are read together, unpadded, and their keys and values are
    placed right-aligned in one cache whose padding columns the mask hides. Every real token sees what it sees
    in the padded forward (the same keys, at the same positions), and no column is spent on padding."""
    mask = state.attention_mask
    lengths = mask.sum(-1)
    width = ids.shape[1]
    logits = None
    cache = state.cache
    for length in sorted(set(lengths.tolist())):
        rows = (lengths == length).nonzero()[:, 0]
        part = KVCache()
        out = model(ids[rows, width - length:], past_key_values=part, use_cache=True, logits_to_keep=1).logits[:, -1]
        if logits is None:
            logits = out.new_empty(ids.shape[0], out.shape[-1])
        logits[rows] = out
        for layer in part.keys:
            if layer not in cache.keys:  # room for the decoding steps too, so the buffers need not grow
                k, v = part.keys[layer], part.values[layer]
                cache.keys[layer] = k.new_zeros(ids.shape[0], k.shape[1], 2 * width, k.shape[3])
                cache.values[layer] = v.new_zeros(ids.shape[0], v.shape[1], 2 * width, v.shape[3])
                cache.lengths[layer] = width
            cache.keys[layer][rows, :, width - length:width] = part.keys[layer][:, :, :length]
            cache.values[layer][rows, :, width - length:width] = part.values[layer][:, :, :length]
    # what generation_logits keeps after a padded prompt: the mask, and each row's last position
    state.extra["padded"] = True
    state.extra["position"] = (lengths - 1)[:, None]
    return logits
