"""Encoder-decoder models (T5, BART) in the serving engine: the source encoded once, its cross-attention keys and
values kept with the request's slot, the decoder's self-attention in the engine's slots.

At admission a request takes `generate`'s own first step, alone, through the model's decoding interface
(`prepare_generation`: the encoder over the source, the decoder prompt; `generation_logits`: the decoder over that
prompt, which fills the cross-attention keys and values of every layer): its self-attention keys go into the
request's slot of the engine's `SlotCache`, its cross-attention keys and values into the same slot of a second
`SlotCache` (positions 0..S-1 of the source). A decoding step then runs every row together: row i feeds its last
token at decoder position L_i; its self-attention keys are read right-aligned as generate's left-padded batch
reads them (`AlignedDecodeView`: so that T5's relative bias, which sees key - query columns, gets position
differences), the padding columns masked; its cross-attention reads the first S_i of the padded source columns.
"""
from __future__ import annotations

import torch

from lmkit.errors import GenerationError
from lmkit.generation.slots import DecodeView, SlotCache


class AlignedDecodeView(DecodeView):
    """The cache as one decoding step over the rows `slots` sees it, each row's keys 0..lengths[i] at the right
    edge of past + 1 columns (`mask` (B, past + 1): 1 at a row's keys); `cross` holds each decoder layer's
    cross-attention keys and values, (B, kv heads, S, D), which the model's cross-attention reads instead of the
    encoder output."""

    def __init__(self, cache: SlotCache, slots: list[int], device: torch.device):
        super().__init__(cache, slots, device)
        shift = self.past - self.lengths  # columns of padding before each row's keys
        columns = torch.arange(self.past + 1, device=device)[None]
        self.mask = (columns >= shift[:, None]).long()
        self.index = (columns - shift[:, None]).clamp(min=0)  # the slot position each column shows (padding: 0)

    def update(self, layer: int, k: torch.Tensor, v: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        keys, values = super().update(layer, k, v)  # each row's keys left-aligned
        index = self.index[:, None, :, None].expand(-1, k.shape[1], -1, k.shape[3])
        return keys.gather(2, index), values.gather(2, index)


class EncoderDecoderRows:
    """The encoder-decoder side of an `Engine`: `admit` a request (encode, first step), `logits` of a decoding step
    over several rows; `cross` holds each slot's cross-attention keys and values."""

    def __init__(self, model, slots: int):
        self.model = model
        self.cross = SlotCache(slots)

    @staticmethod
    def check(request) -> None:
        """Refuse what an encoder-decoder's request cannot have in the engine."""
        if request.prompt_logprobs is not None or request.score_only or request.processors \
                or request.adapter is not None:
            raise GenerationError("an encoder-decoder's prompt is its source: the engine gives it no prompt "
                                  "log-probabilities, structured outputs or adapters; leave them out")

    def admit(self, request, cache: SlotCache) -> torch.Tensor:
        """Encode `request`'s source and run the decoder over its decoder prompt, as generate's first step does
        alone; keep the keys and values in its slot and return the logits (1, V) of its first new token."""
        device = next(self.model.parameters()).device
        start_id = request.decoding.config.decoder_start_token_id
        start, state = self.model.prepare_generation(torch.tensor([request.prompt], device=device), None,
                                                     decoder_start_token_id=start_id)
        logits = self.model.generation_logits(state, start)
        request.decoder_prompt = start[0].tolist()
        kv, n = state.cache, start.shape[1]
        cache.write(request.slot, 0, torch.stack([torch.stack((kv.keys[i][0, :, :n], kv.values[i][0, :, :n]))
                                                  for i in sorted(kv.keys)]))
        self.cross.write(request.slot, 0, torch.stack([torch.stack((k[0], v[0]))
                                                       for _, (k, v) in sorted(kv.cross.items())]))
        return logits.float()

    def logits(self, cache: SlotCache, slots: list[int], tokens: torch.Tensor) -> torch.Tensor:
        """Logits (B, V) after each row's token (B, 1) at its slot's decoder position."""
        view = AlignedDecodeView(cache, slots, tokens.device)
        sources = [self.cross.lengths[s] for s in slots]
        width = max(sources)
        view.cross = {layer: (keys[:, :, :width].index_select(0, view.rows),
                              self.cross.values[layer][:, :, :width].index_select(0, view.rows))
                      for layer, keys in self.cross.keys.items()}
        source_mask = (torch.arange(width, device=tokens.device)[None]
                       < torch.tensor(sources, device=tokens.device)[:, None]).long()
        # the cross-attention reads its keys and values from the view: the encoder output only sets their number
        memory = torch.zeros((), device=tokens.device).expand(len(slots), width, self.model.config.d_model)
        out = self.model(attention_mask=source_mask, decoder_input_ids=tokens, decoder_attention_mask=view.mask,
                         decoder_position_ids=view.lengths[:, None], encoder_outputs=memory, past_key_values=view,
                         use_cache=True, logits_to_keep=1)
        return out.logits[:, -1]
