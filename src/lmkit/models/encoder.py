"""Encoder-only models (BERT, RoBERTa, DistilBERT): the shared `Stack` without the causal mask, plus heads.

Every position attends to every unpadded position; BERT-style stacks are post-norm,
x = LN(x + F(x)), with a LayerNorm right after the summed token, position and segment embeddings.
The head (see `lmkit.models.heads`) is part of the config (`config.task.head`), so a model
saved in lmkit's own format comes back with the same head.
"""
from __future__ import annotations

import dataclasses

import torch
import torch.nn.functional as F
from torch import nn

from lmkit.config import ModelConfig
from lmkit.errors import ConfigError
from lmkit.models.base import PreTrainedModel
from lmkit.models.heads import HEADS, MaskedLMHead, Pooler
from lmkit.models.output import ModelOutput
from lmkit.models.stack import Stack
_UNSET = object()
IGNORE_INDEX = -100  # labels that score nothing (padding, unmasked positions)
NEEDS_POOLER = ("pretraining", "nsp", "sequence", "choice")


def padding_skipping_positions(input_ids: torch.Tensor, pad_token_id: int) -> torch.Tensor:
    """RoBERTa's positions: the count of non-pad tokens up to t, minus one; -1 at padding.

    With position_offset = pad + 1 the table index is pad + 1 + (#non-pad before t) and pad at padding.
    """
    keep = (input_ids != pad_token_id).long()
    return torch.cumsum(keep, dim=1) * keep - 1



def flatten_choices(input_ids, inputs_embeds, *per_token):
    """Multiple choice: (B, C, T) inputs -> (B * C, T) rows, each choice scored as its own row; returns
    (C, input_ids, inputs_embeds, per_token tensors), None staying None."""
    choices = (input_ids if input_ids is not None else inputs_embeds).shape[1]
    flat = tuple(None if x is None else x.reshape(-1, x.shape[-1]) for x in (input_ids, *per_token))
    return choices, flat[0], None if inputs_embeds is None else inputs_embeds.flatten(0, 1), flat[1:]

class Encoder(PreTrainedModel):
    """A bidirectional stack with an optional pooler and one head.

    head: None (bare encoder), "mlm", "pretraining" (MLM + NSP), "nsp", "sequence" (classification or,
    with num_labels=1, regression on the pooled output), "token" (per-position labels), "qa" (start/end),
    "choice" (multiple choice: inputs (B, C, T), one score per choice from the pooled output, logits (B, C)).
    pooler: None, "tanh" or "relu" (dense + activation on the pooled hidden state); pooling: "cls" or "mean".
    """

    def __init__(self, config: ModelConfig, head=_UNSET, num_labels: int | None = None, pooling: str | None = None,
                 pooler=_UNSET):
        task = config.task
        head = task.get("head", "mlm") if head is _UNSET else head
        if head not in HEADS:
            raise ConfigError(f"encoder head {head!r} is not supported; choose one of {', '.join(map(str, HEADS))}")
        num_labels = int(num_labels if num_labels is not None else task.get("num_labels", 2))
        pooling = pooling or task.get("pooling", "cls")
        if pooler is _UNSET:
            pooler = task.get("pooler", "tanh" if head in NEEDS_POOLER else None)
        if head in NEEDS_POOLER and pooler is None:
            raise ConfigError(f"the {head!r} head reads the pooler output; pass pooler='tanh' or 'relu'")
        task = dataclasses.replace(task, head=head, num_labels=num_labels, pooling=pooling, pooler=pooler)
        config = config.replace(task=task, architecture="encoder")
        super().__init__(config)
        self.head, self.num_labels = head, num_labels
        d = config.d_model
        self.encoder = Stack(config, causal=False)
        self.pooler = Pooler(d, pooling, pooler) if pooler else None
        self.mlm_head = MaskedLMHead(config, self.encoder.embeddings.tokens) if head in ("mlm", "pretraining") else None
        self.nsp_head = nn.Linear(d, 2) if head in ("pretraining", "nsp") else None
        classes = 1 if head == "choice" else num_labels  # multiple choice scores each choice alone
        self.classifier = nn.Linear(d, classes) if head in ("sequence", "token", "choice") else None
        self.qa_outputs = nn.Linear(d, 2) if head == "qa" else None
        classifier_dropout = config.task.get("classifier_dropout")  # 0.0 is a setting, None means hidden dropout
        self.dropout = nn.Dropout(config.dropout if classifier_dropout is None else classifier_dropout)
        self.init_weights()

    def get_input_embeddings(self) -> nn.Embedding:
        return self.encoder.embeddings.tokens

    def forward(self, input_ids: torch.Tensor | None = None, attention_mask: torch.Tensor | None = None,
                token_type_ids: torch.Tensor | None = None, position_ids: torch.Tensor | None = None,
                inputs_embeds: torch.Tensor | None = None, labels: torch.Tensor | None = None,
                next_sentence_label: torch.Tensor | None = None, start_positions: torch.Tensor | None = None,
                end_positions: torch.Tensor | None = None,
                global_attention_mask: torch.Tensor | None = None) -> ModelOutput:
        """Hidden states (B, T, d) and the head's logits; with labels, the head's mean loss.

        global_attention_mask (B, T), Longformer only: 1 marks a token that attends to, and is attended by, every
        token; a Longformer sequence head without one makes the first token global, as transformers does.

        position_ids index the position table as transformers' classes do: from 0 for BERT and DistilBERT, and as
        table rows for RoBERTa (whose own positions start at pad + 1)."""
        cfg = self.config
        if self.head == "choice":
            choices, input_ids, inputs_embeds, (attention_mask, token_type_ids, position_ids, global_attention_mask) = \
                flatten_choices(input_ids, inputs_embeds, attention_mask, token_type_ids, position_ids, global_attention_mask)
        if global_attention_mask is None and self.head == "sequence" \
                and cfg.sparse.get("sparse_attention") == "longformer":
            ref = input_ids if input_ids is not None else inputs_embeds[..., 0]
            global_attention_mask = torch.zeros(ref.shape, dtype=torch.long, device=ref.device)
            global_attention_mask[:, 0] = 1
        if cfg.position_skip_padding and position_ids is not None:
            # RobertaEmbeddings indexes its table with given position_ids as they are (its own start at pad + 1)
            position_ids = position_ids - cfg.position_offset
        elif cfg.position_skip_padding and input_ids is not None:
            position_ids = padding_skipping_positions(input_ids, cfg.pad_token_id)
        h = self.encoder(input_ids, attention_mask=attention_mask, position_ids=position_ids,
                         token_type_ids=token_type_ids, inputs_embeds=inputs_embeds,
                         global_attention_mask=global_attention_mask)
        out = ModelOutput(last_hidden_state=h)
        if cfg.n_experts:  # the unscaled load-balancing loss over unpadded tokens; trainers add coef * aux_loss
            out.aux_loss, out.router_logits = self.encoder.aux_loss(attention_mask), self.encoder.router_logits()
        if self.pooler is not None:
            out.pooler_output = self.pooler(h, attention_mask)
        losses = []
        if self.mlm_head is not None:
            out.logits = self.mlm_head(h)
            if labels is not None:
                losses.append(F.cross_entropy(out.logits.flatten(0, 1).float(), labels.reshape(-1),
                                              ignore_index=IGNORE_INDEX))
        if self.nsp_head is not None:
            nsp = self.nsp_head(out.pooler_output)
            nsp_labels = next_sentence_label if self.head == "pretraining" else labels
            if self.head == "pretraining":
                out.nsp_logits = nsp
            else:
                out.logits = nsp
            if nsp_labels is not None:
                losses.append(F.cross_entropy(nsp.float(), nsp_labels.reshape(-1)))
        if self.head == "sequence":
            out.logits = self.classifier(self.dropout(out.pooler_output))
            if labels is not None:
                losses.append(self._sequence_loss(out.logits, labels))
        elif self.head == "choice":
            out.logits = self.classifier(self.dropout(out.pooler_output)).view(-1, choices)
            if labels is not None:
                losses.append(F.cross_entropy(out.logits.float(), labels.reshape(-1)))
        elif self.head == "token":
            out.logits = self.classifier(self.dropout(h))
            if labels is not None:
                losses.append(F.cross_entropy(out.logits.flatten(0, 1).float(), labels.reshape(-1),
                                              ignore_index=IGNORE_INDEX))
        elif self.head == "qa":
            out.logits = self.qa_outputs(h)
            out.start_logits, out.end_logits = (x.squeeze(-1).contiguous() for x in out.logits.split(1, dim=-1))
            if start_positions is not None and end_positions is not None:
                T = h.shape[1]  # positions past the end are ignored, as transformers does
                start, end = (p.reshape(-1).clamp(0, T) for p in (start_positions, end_positions))  # (B,) or (B, 1)
                losses.append((F.cross_entropy(out.start_logits.float(), start, ignore_index=T)
                               + F.cross_entropy(out.end_logits.float(), end, ignore_index=T)) / 2)
        if losses:
            out.loss = torch.stack(losses).sum()
        return out

    def _sequence_loss(self, logits: torch.Tensor, labels: torch.Tensor) -> torch.Tensor:
        """By config.task.problem_type, else as transformers infers it: mean squared error for one output or
        "regression", cross-entropy over the classes for integer labels, else per-class sigmoid BCE (multi-label)."""
        kind = self.config.task.get("problem_type")
        if kind is None:
            kind = "regression" if self.num_labels == 1 else "single_label_classification" \
                if labels.dtype in (torch.long, torch.int) else "multi_label_classification"
        if kind == "regression":
            if self.num_labels == 1:
                return F.mse_loss(logits.squeeze(-1).float(), labels.float().reshape(-1))
            return F.mse_loss(logits.float(), labels.float())
        if kind == "multi_label_classification":
            return F.binary_cross_entropy_with_logits(logits.float(), labels.float())
        return F.cross_entropy(logits.float(), labels.reshape(-1))
