"""Task heads on top of an encoder's hidden states H (B, T, d).

pooling:        cls: H[:, 0];  mean: sum_t m_t H_t / sum_t m_t over the attention mask m
Pooler:         act(W pool(H) + b)          (BERT/RoBERTa: tanh; DistilBERT's pre-classifier: ReLU)
MaskedLMHead:   LN(act(W H + b)) W_E^T + b_V (the output matrix is the token embedding matrix)
sequence / NSP: a linear layer on the pooler output; token classification: a linear layer per position;
question answering: start and end logits from one (d -> 2) linear layer; multiple choice: a (d -> 1) linear layer
on each choice's pooler output, the C scores of a question side by side.
"""
from __future__ import annotations

import torch
from torch import nn

from lmkit.config import ModelConfig
from lmkit.errors import ConfigError
from lmkit.nn.ffn import activation
from lmkit.nn.norms import build_norm

# head name -> (what it predicts); None is the bare encoder
HEADS = (None, "mlm", "pretraining", "nsp", "sequence", "token", "qa", "choice")
POOLINGS = ("cls", "mean")
# tanh and ReLU (BERT, DistilBERT); BigBird's classifier runs the model's hidden activation
POOLER_ACTIVATIONS = {"tanh": torch.tanh, **{name: activation(name) for name in ("relu", "gelu", "gelu_tanh", "silu")}}


def pool(h: torch.Tensor, attention_mask: torch.Tensor | None, mode: str) -> torch.Tensor:
    """(B, T, d) -> (B, d): the first position, or the mean over positions the mask keeps."""
    if mode == "cls":
        return h[:, 0]
    if attention_mask is None:
        return h.mean(dim=1)
    if attention_mask.dim() != 2:
        raise ConfigError(f"mean pooling reads a (batch, length) attention_mask, not one of shape "
                          f"{tuple(attention_mask.shape)}; pass the 2-D padding mask")
    m = attention_mask.to(h.dtype).unsqueeze(-1)
    return (h * m).sum(dim=1) / m.sum(dim=1).clamp(min=1e-9)


class Pooler(nn.Module):
    """act(W pool(H) + b): BERT's pooler, RoBERTa's classifier.dense, DistilBERT's pre_classifier."""

    def __init__(self, d_model: int, pooling: str = "cls", act: str = "tanh"):
        super().__init__()
        if pooling not in POOLINGS:
            raise ConfigError(f"pooling={pooling!r} is not supported; choose one of {', '.join(POOLINGS)}")
        if act not in POOLER_ACTIVATIONS:
            raise ConfigError(f"pooler activation {act!r} is not supported; choose one of {', '.join(POOLER_ACTIVATIONS)}")
        self.pooling, self.act_name = pooling, act
        self.act = POOLER_ACTIVATIONS[act]
        self.dense = nn.Linear(d_model, d_model)

    def forward(self, h: torch.Tensor, attention_mask: torch.Tensor | None = None) -> torch.Tensor:
        return self.act(self.dense(pool(h, attention_mask, self.pooling)))


class MaskedLMHead(nn.Module):
    """LN(act(dense(H))) times the output matrix plus a per-token bias; the matrix is W_E when tied."""

    def __init__(self, config: ModelConfig, embedding: nn.Embedding):
        super().__init__()
        d = config.d_model
        self.dense = nn.Linear(d, d)
        self.act = activation(config.task.get("mlm_activation", config.activation))
        self.norm = build_norm(config)
        self.decoder = nn.Linear(d, config.vocab_size, bias=False)
        if config.tie_embeddings:
            self.decoder.weight = embedding.weight
        self.bias = nn.Parameter(torch.zeros(config.vocab_size))

    def forward(self, h: torch.Tensor) -> torch.Tensor:
        return self.decoder(self.norm(self.act(self.dense(h)))) + self.bias
