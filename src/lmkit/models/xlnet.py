"""XLNet: a stack of two-stream Transformer-XL layers (position kind "xl") with segment recurrence, and its heads.

Masks, with m memory positions before the T new ones (key j, query i at m + i):
  architecture "encoder" (attn_type "bi"): a query sees every key; "decoder" ("uni"): keys j <= m + i only, and with
  same_length also j >= i (every query then sees m + 1 keys);
  perm_mask[b, i, j] = 1 hides new position j from i (the factorization order); padding hides padded keys.
The query stream (rows of target_mapping, started from mask_emb) uses that mask; the content stream also sees itself.
The memory of layer l is its input h over the last mem_len positions of [old memory; this call's first reuse_len],
time-major (T, B, d) and detached, as transformers' `mems`.
head (config.task.head): None (XLNetModel), "lm" (XLNetLMHeadModel: W_E^T + b), "sequence" and "choice" (the
sequence summary, then logits_proj), "token" (classifier per position), "qa" (start/end logits, qa_outputs).
"""
from __future__ import annotations

import dataclasses

import torch
import torch.nn.functional as F
from torch import nn

from lmkit.config import ModelConfig
from lmkit.errors import ConfigError, GenerationError
from lmkit.generation import GenerationMixin
from lmkit.generation.interface import DecodingState
from lmkit.models.base import PreTrainedModel
from lmkit.models.encoder import IGNORE_INDEX, Encoder, flatten_choices
from lmkit.models.output import ModelOutput
from lmkit.models.xlnet_heads import SequenceSummary
from lmkit.nn.dropout import dropout
from lmkit.nn.embeddings import Embeddings
from lmkit.nn.xl_attention import TwoStreamBlock, relative_distances, relative_encoding

_UNSET = object()
HEADS = (None, "lm", "sequence", "token", "choice", "qa")


class XLNetStack(nn.Module):
    """Token embeddings, mask_emb (the query stream's start) and the two-stream layers."""

    def __init__(self, config: ModelConfig):
        super().__init__()
        self.config = config
        self.embeddings = Embeddings(config)  # position "xl" and no segment table: the token lookup and dropout
        self.mask_emb = nn.Parameter(torch.zeros(1, 1, config.d_model))
        self.layers = nn.ModuleList(TwoStreamBlock(config) for _ in range(config.n_layers))

    def _masks(self, B: int, T: int, mlen: int, attention_mask, input_mask, perm_mask, device):
        """(blocked for the query stream, blocked for the content stream), (B, T, m + T) bool, or None."""
        K = mlen + T
        blocked = None
        if self.config.architecture == "decoder":
            i, j = torch.arange(T, device=device)[:, None], torch.arange(K, device=device)[None, :]
            blocked = j > mlen + i
            if self.config.same_length:
                blocked = blocked | (j < i)
            blocked = blocked[None].expand(B, T, K)
        if input_mask is None and attention_mask is not None:
            input_mask = 1.0 - attention_mask.float()
        data = None
        if input_mask is not None:
            data = input_mask.float()[:, None, :].expand(B, T, T)
        if perm_mask is not None:
            data = perm_mask.float() if data is None else data + perm_mask.float()
        if data is not None:
            data = F.pad(data > 0, (mlen, 0), value=False)  # memory is visible to every query
            blocked = data if blocked is None else blocked | data
        if blocked is None:
            return None, None
        itself = torch.arange(K, device=device)[None, :] == mlen + torch.arange(T, device=device)[:, None]
        return blocked, blocked & ~itself

    def _cache(self, h: torch.Tensor, previous: torch.Tensor | None) -> torch.Tensor:
        """The layer's next memory (T', B, d): the last mem_len of [previous; h[:reuse_len]], detached."""
        cfg = self.config
        current = h.transpose(0, 1)
        if cfg.reuse_len:
            current = current[:cfg.reuse_len]
        memory = current if previous is None else torch.cat([previous.to(current.dtype), current], dim=0)
        return (memory[-cfg.mem_len:] if cfg.mem_len else memory).detach()

    def forward(self, input_ids=None, attention_mask=None, token_type_ids=None, perm_mask=None, target_mapping=None,
                mems=None, use_mems=False, input_mask=None, inputs_embeds=None):
        """(the last hidden states (B, T, d), or the query stream's (B, M, d) with target_mapping; new mems or None)."""
        if input_ids is not None and inputs_embeds is not None:
            raise ConfigError("pass input_ids or inputs_embeds, not both")
        if input_mask is not None and attention_mask is not None:
            raise ConfigError("pass attention_mask (1 = token) or input_mask (1 = padding), not both")
        h = self.embeddings(input_ids, inputs_embeds=inputs_embeds)
        B, T, _ = h.shape
        if mems is not None and len(mems) != len(self.layers):
            raise ConfigError(f"mems holds {len(mems)} layers' memory but the model has {len(self.layers)} layers; "
                              "pass the mems a previous call returned")
        mlen = mems[0].shape[0] if mems is not None and mems[0] is not None else 0
        blocked_g, blocked_h = self._masks(B, T, mlen, attention_mask, input_mask, perm_mask, h.device)
        other_segment = None
        if token_type_ids is not None:  # memory positions count as segment 0
            keys = F.pad(token_type_ids, (mlen, 0), value=0)
            other_segment = token_type_ids[:, :, None] != keys[:, None, :]
        distances, index = relative_distances(T, mlen + T, self.config.clamp_len, h.device)
        encoding = relative_encoding(distances, self.config.d_model)
        encoding = dropout(encoding, self.config.dropout, self.training)
        g = None
        if target_mapping is not None:
            g = self.mask_emb.expand(B, target_mapping.shape[1], -1).to(h.dtype)
            g = dropout(g, self.config.dropout, self.training)
        new_mems = [] if use_mems else None
        for i, layer in enumerate(self.layers):
            memory = mems[i] if mems is not None else None
            if use_mems:
                new_mems.append(self._cache(h, memory))
            h, g = layer(h, g, None if memory is None or memory.dim() < 2 else memory.transpose(0, 1), encoding,
                         index, other_segment, blocked_h, blocked_g, target_mapping)
        out = dropout(g if g is not None else h, self.config.dropout, self.training)
        return out, tuple(new_mems) if use_mems else None


class XLNet(PreTrainedModel, GenerationMixin):
    """XLNetModel, XLNetLMHeadModel and the task heads of transformers, by config.task.head."""

    _sequence_loss = Encoder._sequence_loss  # transformers' problem_type rules, as for the encoders' heads

    def __init__(self, config: ModelConfig, head=_UNSET, num_labels: int | None = None):
        head = config.task.get("head", "lm") if head is _UNSET else head
        if head not in HEADS:
            raise ConfigError(f"XLNet head {head!r} is not supported; choose one of {', '.join(map(str, HEADS))}")
        num_labels = int(num_labels if num_labels is not None else config.task.get("num_labels", 2))
        config = config.replace(task=dataclasses.replace(config.task, head=head, num_labels=num_labels))
        super().__init__(config)
        self.head, self.num_labels = head, num_labels
        d = config.d_model
        self.transformer = XLNetStack(config)
        self.lm_head = nn.Linear(d, config.vocab_size, bias=True) if head == "lm" else None
        if self.lm_head is not None and config.tie_embeddings:
            self.lm_head.weight = self.transformer.embeddings.tokens.weight
        self.sequence_summary = SequenceSummary(config) if head in ("sequence", "choice") else None
        self.logits_proj = nn.Linear(d, 1 if head == "choice" else num_labels) if self.sequence_summary else None
        self.classifier = nn.Linear(d, num_labels) if head == "token" else None
        self.qa_outputs = nn.Linear(d, 2) if head == "qa" else None
        self.init_weights()

    def init_weights(self) -> None:
        """Normal(0, init_std) for every matrix, the biases and segment encodings of attention and mask_emb; zeros
        for linear biases (transformers' XLNet init)."""
        super().init_weights()
        std = self.config.init_std
        for name, p in self.named_parameters():
            if name.endswith(("r_w_bias", "r_r_bias", "r_s_bias", "seg_embed", "mask_emb", "o_proj.weight")):
                nn.init.normal_(p, std=std)

    def get_input_embeddings(self) -> nn.Embedding:
        return self.transformer.embeddings.tokens

    def forward(self, input_ids: torch.Tensor | None = None, attention_mask: torch.Tensor | None = None,
                token_type_ids: torch.Tensor | None = None, perm_mask: torch.Tensor | None = None,
                target_mapping: torch.Tensor | None = None, mems=None, use_mems: bool | None = None,
                input_mask: torch.Tensor | None = None, inputs_embeds: torch.Tensor | None = None,
                labels: torch.Tensor | None = None, logits_to_keep: int = 0,
                start_positions: torch.Tensor | None = None, end_positions: torch.Tensor | None = None,
                cls_index: torch.Tensor | None = None) -> ModelOutput:
        """last_hidden_state, the head's logits and `mems` (use_mems default: config.use_mems_eval, or
        use_mems_train in training mode); with labels, the head's mean loss as transformers computes it."""
        if use_mems is None:
            use_mems = self.config.use_mems_train if self.training else self.config.use_mems_eval
        choices = None
        if self.head == "choice":
            choices, input_ids, inputs_embeds, (attention_mask, token_type_ids, input_mask) = flatten_choices(
                input_ids, inputs_embeds, attention_mask, token_type_ids, input_mask)
        h, new_mems = self.transformer(input_ids, attention_mask, token_type_ids, perm_mask, target_mapping, mems,
                                       use_mems, input_mask, inputs_embeds)
        out = ModelOutput(last_hidden_state=h, mems=new_mems)
        if self.head == "lm":
            out.logits = self.lm_head(h[:, -logits_to_keep:] if logits_to_keep else h)
            if labels is not None:
                out.loss = F.cross_entropy(out.logits.flatten(0, 1).float(), labels.reshape(-1),
                                           ignore_index=IGNORE_INDEX)
        elif self.head in ("sequence", "choice"):
            out.logits = self.logits_proj(self.sequence_summary(h, cls_index))
            if choices is not None:
                out.logits = out.logits.view(-1, choices)
                if labels is not None:
                    out.loss = F.cross_entropy(out.logits.float(), labels.reshape(-1))
            elif labels is not None:
                out.loss = self._sequence_loss(out.logits, labels)
        elif self.head == "token":
            out.logits = self.classifier(h)
            if labels is not None:
                out.loss = F.cross_entropy(out.logits.flatten(0, 1).float(), labels.reshape(-1),
                                           ignore_index=IGNORE_INDEX)
        elif self.head == "qa":
            out.logits = self.qa_outputs(h)
            out.start_logits, out.end_logits = (x.squeeze(-1).contiguous() for x in out.logits.split(1, dim=-1))
            if start_positions is not None and end_positions is not None:
                T = h.shape[1]  # positions past the end are ignored, as transformers does
                start, end = (p.reshape(-1).clamp(0, T) for p in (start_positions, end_positions))
                out.loss = (F.cross_entropy(out.start_logits.float(), start, ignore_index=T)
                            + F.cross_entropy(out.end_logits.float(), end, ignore_index=T)) / 2
        return out

    # --- generation: transformers' XLNetLMHeadModel scheme ------------------------------------------------
    def prepare_generation(self, input_ids: torch.Tensor, attention_mask: torch.Tensor | None, use_mems=None,
                           **model_kwargs) -> tuple[torch.Tensor, DecodingState]:
        """Each step appends a dummy token that the whole sequence is hidden from (perm_mask) and predicts it through
        the query stream (target_mapping). With memory (use_mems, default config.use_mems_eval) a step after the
        first feeds the last two tokens and the dummy over the memory less its last two positions (transformers'
        offset 2); without, it recomputes the whole sequence. Like transformers, the attention mask is not used."""

        if self.head != "lm":
            raise GenerationError("generate needs an XLNet with its language-model head (XLNetLMHeadModel)")
        if model_kwargs:
            raise GenerationError(f"generate() got arguments it does not know: {', '.join(sorted(model_kwargs))}")
        return input_ids, DecodingState(cache=None, extra={"sequence": input_ids[:, :0], "use_mems": use_mems})

    def generation_logits(self, state: DecodingState, tokens: torch.Tensor) -> torch.Tensor:
        sequence = state.extra["sequence"] = torch.cat([state.extra["sequence"], tokens], dim=1)
        offset, mems = 2, state.cache
        inputs = sequence[:, -offset:] if mems else sequence
        inputs = F.pad(inputs, (0, 1), value=0)
        B, T = inputs.shape
        perm_mask = inputs.new_zeros((B, T, T), dtype=torch.float)
        perm_mask[:, :, -1] = 1.0
        target_mapping = inputs.new_zeros((B, 1, T), dtype=torch.float)
        target_mapping[:, 0, -1] = 1.0
        out = self(inputs, perm_mask=perm_mask, target_mapping=target_mapping, use_mems=state.extra["use_mems"],
                   mems=tuple(m[:-offset] for m in mems) if mems else None)
        state.cache = out.mems
        return out.logits[:, -1]

    def reorder_generation(self, state: DecodingState, index: torch.Tensor) -> None:
        state.extra["sequence"] = state.extra["sequence"].index_select(0, index)
        if state.cache:
            state.cache = tuple(m.index_select(1, index) for m in state.cache)

    def check_context(self, input_ids: torch.Tensor, max_new_tokens: int) -> None:
        """XLNet has no position table: any length fits."""
