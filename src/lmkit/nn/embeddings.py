"""Input embeddings: token lookup (one-hot times W_E), learned or sinusoidal positions, segments.

h_i = scale * W_E[x_i] + P[i + offset] + S[t_i], then an optional LayerNorm and dropout.
"""
from __future__ import annotations

import torch
from torch import nn

from lmkit.config import ModelConfig
from lmkit.errors import SequenceTooLongError
from lmkit.nn.dropout import Dropout
from lmkit.nn.norms import build_norm
from lmkit.nn.positions import sinusoidal_table


class Embeddings(nn.Module):
    """Token embeddings plus the additive position and segment embeddings the config asks for."""

    def __init__(self, config: ModelConfig):
        super().__init__()
        self.config = config
        self.tokens = nn.Embedding(config.vocab_size, config.d_model, padding_idx=None)
        self.positions = None
        n_pos = config.max_seq_len + config.position_offset
        if config.position == "learned":
            self.positions = nn.Embedding(n_pos, config.d_model)
        elif config.position == "sinusoidal":
            self.register_buffer("sinusoidal", sinusoidal_table(n_pos, config.d_model, config.sinusoidal_base),
                                 persistent=False)
        self.token_types = nn.Embedding(config.type_vocab_size, config.d_model) if config.type_vocab_size else None
        self.norm = build_norm(config) if config.embedding_norm else None
        self.dropout = Dropout(config.dropout)

    def forward(self, input_ids: torch.Tensor | None, position_ids: torch.Tensor | None = None,
                token_type_ids: torch.Tensor | None = None, inputs_embeds: torch.Tensor | None = None) -> torch.Tensor:
        """scale * W_E[ids] (or inputs_embeds as given, in place of the token lookup, as transformers takes them)
        plus positions and segments, then the embedding norm."""
        if inputs_embeds is None:
            h = self.tokens(input_ids)
            if self.config.embedding_scale != 1.0:
                h = h * self.config.embedding_scale
        else:
            h = inputs_embeds
        if self.config.position in ("learned", "sinusoidal"):
            if position_ids is None:
                position_ids = torch.arange(h.shape[1], device=h.device)[None]
            if self.config.position_offset:
                position_ids = position_ids + self.config.position_offset
            if int(position_ids.max()) >= self.config.max_seq_len + self.config.position_offset:
                n = self.config.max_seq_len
                raise SequenceTooLongError(
                    f"a sequence reaches position {int(position_ids.max()) - self.config.position_offset} but the model "
                    f"has only {n} positions (0..{n - 1}); feed at most {n} tokens per row, virtual prompt tokens "
                    f"included (training: a smaller --seq-len / --max-length; generation: a shorter prompt or fewer "
                    f"max_new_tokens)")
            if self.positions is not None:
                h = h + self.positions(position_ids)
            else:
                h = h + self.sinusoidal[position_ids].to(h.dtype)
        if self.token_types is not None:
            if token_type_ids is None:
                token_type_ids = torch.zeros(h.shape[:2], dtype=torch.long, device=h.device)
            h = h + self.token_types(token_type_ids)
        if self.norm is not None:
            h = self.norm(h)
        return self.dropout(h) if self.training and self.dropout.p > 0 else h
