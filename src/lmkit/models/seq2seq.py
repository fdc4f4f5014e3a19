"""Encoder-decoder language model: p(y_t | y_<t, x) = softmax(W_o D(y_<t, E(x)))_t.

E is a bidirectional `Stack` over the source; D a causal `Stack` whose blocks also cross-attend to
E(x) (queries from the decoder, keys and values from the encoder output). Both stacks share the
token embedding W_E; with tied embeddings W_o = W_E^T, applied to the hidden states times
config.output_scale (T5: d^-0.5). BART adds a fixed bias to the logits (config.output_bias).
Teacher forcing: the decoder reads the targets shifted right behind decoder_start_token_id (mBART: behind
each row's last non-pad target, its language code).
"""
from __future__ import annotations

import torch
from torch import nn

from lmkit.config import ModelConfig
from lmkit.errors import GenerationError
from lmkit.generation import DecodingState, GenerationMixin
from lmkit.models.base import PreTrainedModel
from lmkit.models.output import ModelOutput
from lmkit.models.stack import Stack
from lmkit.nn import Embeddings, KVCache
from lmkit.objectives import IGNORE_INDEX, shift_right, shift_right_wrapped


class Seq2SeqLM(PreTrainedModel, GenerationMixin):
    """T5, BART and friends: encoder stack, decoder stack with cross-attention, language-model head."""

    def __init__(self, config: ModelConfig):
        super().__init__(config)
        enc_emb, dec_emb = Embeddings(config), Embeddings(config)
        if not config.separate_stack_embeddings:  # BART untied in transformers 5: a table per stack
            dec_emb.tokens = enc_emb.tokens  # one shared token table; positions and norms stay per stack
        self.encoder = Stack(config, causal=False, embeddings=enc_emb)
        self.decoder = Stack(config, causal=True, cross=True, n_layers=config.decoder_layers, embeddings=dec_emb)
        self.lm_head = nn.Linear(config.d_model, config.vocab_size, bias=False)
        if config.tie_embeddings:
            self.lm_head.weight = enc_emb.tokens.weight
        if config.output_bias:
            self.register_buffer("final_logits_bias", torch.zeros(1, config.vocab_size))
        else:
            self.final_logits_bias = None
        self.init_weights()

    def init_weights(self) -> None:
        """The base init; without the 1/sqrt(d_k) of the scores (T5, attention_scale=1), T5's init instead,
        which folds that factor into W_q: std(W_q) = (d d_k)^-1/2, W_k, W_v, W_up: d^-1/2,
        W_o: (H d_k)^-1/2, W_down: d_ff^-1/2, embeddings 1 (an untied head d^-1/2)."""
        super().init_weights()
        if self.config.attention_scale != 1.0:
            return
        c = self.config
        inner = c.n_heads * c.resolved_head_dim
        std = {"q_proj": (c.d_model * c.resolved_head_dim) ** -0.5, "k_proj": c.d_model ** -0.5, "v_proj": c.d_model ** -0.5,
               "o_proj": inner ** -0.5, "up_proj": c.d_model ** -0.5, "gate_proj": c.d_model ** -0.5,
               "down_proj": c.resolved_d_ff ** -0.5}
        for name, module in self.named_modules():
            last = name.rsplit(".", 1)[-1]
            if isinstance(module, nn.Linear) and last in std:
                nn.init.normal_(module.weight, std=std[last])
            elif isinstance(module, nn.Embedding):
                nn.init.normal_(module.weight, std=c.d_model ** -0.5 if name.endswith("relative_bias.bias") else 1.0)
        if not c.tie_embeddings:
            nn.init.normal_(self.lm_head.weight, std=c.d_model ** -0.5)

    def get_input_embeddings(self) -> nn.Embedding:
        return self.encoder.embeddings.tokens

    @property
    def decoder_start_token_id(self) -> int:
        c = self.config
        for value in (c.decoder_start_token_id, c.pad_token_id, c.bos_token_id):
            if value is not None:
                return int(value)
        return 0

    def encode(self, input_ids: torch.Tensor, attention_mask: torch.Tensor | None = None) -> torch.Tensor:
        """Encoder output E(x), (B, S, d); padded source positions are masked as keys."""
        return self.encoder(input_ids, attention_mask=attention_mask)

    def forward(self, input_ids: torch.Tensor | None = None, attention_mask: torch.Tensor | None = None,
                decoder_input_ids: torch.Tensor | None = None, decoder_attention_mask: torch.Tensor | None = None,
                encoder_outputs=None, past_key_values: KVCache | None = None, use_cache: bool = False,
                labels: torch.Tensor | None = None, logits_to_keep: int = 0,
                decoder_position_ids: torch.Tensor | None = None) -> ModelOutput:
        """Logits (B, Td, V); with labels (B, Td), the mean cross-entropy over labels != -100.

        Without decoder_input_ids, the decoder reads `labels` shifted right (teacher forcing; mBART wraps the last
        non-pad label to the front).
        `encoder_outputs` (a tensor or a ModelOutput) skips the encoder. `decoder_position_ids` (B, Td): each decoder
        token's position, where rows of one batch stand at different lengths (the serving engine's); default
        past..past + Td - 1.
        """
        if encoder_outputs is None:
            memory = self.encode(input_ids, attention_mask)
        else:
            memory = encoder_outputs if torch.is_tensor(encoder_outputs) else encoder_outputs.last_hidden_state
        if decoder_input_ids is None:
            if labels is None:
                raise ValueError("Seq2SeqLM needs decoder_input_ids or labels")
            pad = self.config.pad_token_id if self.config.pad_token_id is not None else 0
            decoder_input_ids = (shift_right_wrapped(labels, pad) if self.config.decoder_start_from_labels
                                 else shift_right(labels, self.decoder_start_token_id, pad))
        if use_cache and past_key_values is None:
            past_key_values = KVCache()
        past = past_key_values.get_seq_length() if past_key_values is not None else 0
        h = self.decoder(decoder_input_ids, attention_mask=decoder_attention_mask, position_ids=decoder_position_ids,
                         cache=past_key_values, memory=memory, memory_mask=attention_mask)
        length = h.shape[1]
        if logits_to_keep:
            h = h[:, -logits_to_keep:]
        # the head reads h * output_scale (T5 v1.0); last_hidden_state stays the decoder's output, as T5Model's
        logits = self.lm_head(h * self.config.output_scale if self.config.output_scale != 1.0 else h)
        if self.final_logits_bias is not None:
            logits = logits + self.final_logits_bias.to(logits.dtype)
        loss = None
        if labels is not None:
            loss = nn.functional.cross_entropy(logits.reshape(-1, logits.shape[-1]).float(), labels.reshape(-1),
                                               ignore_index=IGNORE_INDEX)
        aux = []
        if self.config.n_experts:  # each stack's load-balancing loss over its own real tokens, summed
            if encoder_outputs is None:
                aux.append(self.encoder.aux_loss(attention_mask))
            rows = decoder_attention_mask
            aux.append(self.decoder.aux_loss(rows[:, past:past + length] if rows is not None else None))
        return ModelOutput(logits=logits, last_hidden_state=h, past_key_values=past_key_values,
                           aux_loss=sum(aux) if aux else None, encoder_last_hidden_state=memory, loss=loss)

    # --- the decoding interface (generation/interface.py) --------------------------------------------
    def _decoder_prompt(self, batch: int, device: torch.device, decoder_input_ids: torch.Tensor | None = None,
                        decoder_start_token_id=None) -> torch.Tensor:
        """What the decoder output starts from, as transformers builds it: decoder_start_token_id (an id, or one
        per row; else the folder's generation config's, else the model config's), and a given decoder prompt
        behind it unless some row already begins with it."""
        if decoder_start_token_id is None:  # the folder's generation config first, as in transformers
            decoder_start_token_id = getattr(self, "generation_defaults", {}).get("decoder_start_token_id")
        if decoder_start_token_id is None:
            decoder_start_token_id = self.decoder_start_token_id
        start = torch.as_tensor(decoder_start_token_id, dtype=torch.long, device=device)
        if start.dim() > 1 or (start.dim() == 1 and start.numel() != batch):
            raise GenerationError(f"decoder_start_token_id must be one id or one per row ({batch}), got shape "
                                  f"{tuple(start.shape)}")
        start = start.reshape(-1, 1).expand(batch, 1)
        if decoder_input_ids is None:
            return start.clone()
        decoder_input_ids = torch.as_tensor(decoder_input_ids, dtype=torch.long, device=device).reshape(batch, -1)
        if decoder_input_ids.shape[1] and bool((decoder_input_ids[:, 0] != start[:, 0]).all()):
            decoder_input_ids = torch.cat([start, decoder_input_ids], dim=1)
        return decoder_input_ids

    def generation_prompt_length(self, input_ids: torch.Tensor, model_kwargs: dict) -> int:
        keys = ("decoder_input_ids", "decoder_start_token_id")
        return self._decoder_prompt(input_ids.shape[0], input_ids.device,
                                    **{k: model_kwargs[k] for k in keys if k in model_kwargs}).shape[1]

    def prepare_generation(self, input_ids: torch.Tensor, attention_mask: torch.Tensor | None,
                           decoder_input_ids: torch.Tensor | None = None, decoder_start_token_id=None,
                           **model_kwargs) -> tuple[torch.Tensor, DecodingState]:
        """Encode the source once; the output starts from the decoder prompt (see `_decoder_prompt`)."""
        if model_kwargs:
            raise GenerationError(f"generate() got arguments it does not know: {', '.join(sorted(model_kwargs))}")
        memory = self.encode(input_ids, attention_mask)
        decoder_input_ids = self._decoder_prompt(input_ids.shape[0], input_ids.device, decoder_input_ids,
                                                 decoder_start_token_id)
        state = DecodingState(cache=KVCache(), attention_mask=attention_mask, extra={"memory": memory})
        return decoder_input_ids, state

    def generation_logits(self, state: DecodingState, tokens: torch.Tensor) -> torch.Tensor:
        out = self(attention_mask=state.attention_mask, decoder_input_ids=tokens, encoder_outputs=state.extra["memory"],
                   past_key_values=state.cache, use_cache=True, logits_to_keep=1)
        return out.logits[:, -1]

    def reorder_generation(self, state: DecodingState, index: torch.Tensor) -> None:
        state.cache.reorder(index)
        state.extra["memory"] = state.extra["memory"].index_select(0, index)
        if state.attention_mask is not None:
            state.attention_mask = state.attention_mask.index_select(0, index)
