"""Decoder-only language model: p(x_t | x_<t) = softmax(H^L W_o)_t over a causal stack.

With tied embeddings W_o = W_E^T (scaled by config.output_scale before the projection).
"""
from __future__ import annotations

import torch
from torch import nn

from lmkit.config import ModelConfig
from lmkit.generation import GenerationMixin
from lmkit.generation.decode_plan import DecodePlan
from lmkit.models.base import PreTrainedModel
from lmkit.models.output import ModelOutput
from lmkit.models.stack import Stack
from lmkit.nn import KVCache
from lmkit.nn.plain import plain


class CausalLM(PreTrainedModel, GenerationMixin):
    """GPT-2, LLaMA, Mixtral and friends: a causal stack and a language-model head."""

    def __init__(self, config: ModelConfig):
        super().__init__(config)
        self.decoder = Stack(config, causal=True)
        self.lm_head = nn.Linear(config.d_model, config.vocab_size, bias=False)
        if config.tie_embeddings:
            self.lm_head.weight = self.decoder.embeddings.tokens.weight
        self.init_weights()

    def get_input_embeddings(self) -> nn.Embedding:
        return self.decoder.embeddings.tokens

    def decode_plan(self, batch: int) -> DecodePlan | None:
        """The plan reproduces this class's forward over a plain Stack (`lmkit.nn.plain`); a subclass's own forward
        decodes as written."""
        if not plain(self, CausalLM) or not plain(self.decoder, Stack):
            return None
        return DecodePlan.build(self, batch)

    def forward(self, input_ids: torch.Tensor | None = None, attention_mask: torch.Tensor | None = None,
                position_ids: torch.Tensor | None = None, past_key_values: KVCache | None = None,
                use_cache: bool = False, inputs_embeds: torch.Tensor | None = None,
                labels: torch.Tensor | None = None, logits_to_keep: int | torch.Tensor = 0,
                output_router_logits: bool | None = None) -> ModelOutput:
        """Logits (B, T, V); with labels (B, T), the mean next-token loss of labels[:, 1:] given inputs[:, :-1].

        A mixture of experts also returns `router_logits` and the unscaled load-balancing `aux_loss` (padding
        left out through attention_mask); as in MixtralForCausalLM, `loss` adds router_aux_loss_coef * aux_loss
        when output_router_logits (default: config.output_router_logits, i.e. config.json's).
        """
        if use_cache and past_key_values is None:
            past_key_values = KVCache()
        past = past_key_values.get_seq_length() if past_key_values is not None else 0
        first = input_ids if input_ids is not None else inputs_embeds
        length = first.shape[1]
        keep = None  # as transformers: the positions listed, in their order, or the last logits_to_keep
        if isinstance(logits_to_keep, torch.Tensor):
            keep = torch.where(logits_to_keep < 0, logits_to_keep + length, logits_to_keep)
        elif logits_to_keep:
            keep = torch.arange(max(length - logits_to_keep, 0), length, device=first.device)
        h = self.decoder(input_ids, attention_mask=attention_mask, position_ids=position_ids,
                         cache=past_key_values, inputs_embeds=inputs_embeds, keep=keep)
        if self.config.output_scale != 1.0:
            h = h * self.config.output_scale
        logits = self.lm_head(h)
        loss = None
        if labels is not None:
            # targets shifted left, the last position ignored: the logits are read in place, not sliced and copied
            targets = nn.functional.pad(labels[:, 1:], (0, 1), value=-100)
            loss = nn.functional.cross_entropy(logits.reshape(-1, logits.shape[-1]).float(), targets.reshape(-1),
                                               ignore_index=-100)
        aux_loss = router_logits = None
        if self.config.n_experts:
            padded = torch.is_tensor(attention_mask) and attention_mask.dim() == 2  # not a prepared 4-D mask or dict
            rows = attention_mask[:, past:past + length] if padded else None
            aux_loss, router_logits = self.decoder.aux_loss(rows), self.decoder.router_logits()
            if output_router_logits is None:
                output_router_logits = self.config.output_router_logits
            if loss is not None and output_router_logits:
                loss = loss + self.config.router_aux_loss_coef * aux_loss
        return ModelOutput(logits=logits, last_hidden_state=h, past_key_values=past_key_values,
                           aux_loss=aux_loss, router_logits=router_logits, loss=loss)
