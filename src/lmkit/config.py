"""`ModelConfig`: one dataclass that describes every model family, and the named presets.

A family differs from another only by these fields (norm placement, position kind, activation,
tying, grouped-query attention), never by a copied class.
"""
from __future__ import annotations

import copy
import dataclasses
import json
from dataclasses import dataclass, field
from typing import Any

from lmkit.config_sections import Compression, SparseAttention, TaskHead, check_types
from lmkit.errors import ConfigError

ARCHITECTURES = ("decoder", "encoder", "encoder-decoder")
POSITIONS = ("learned", "sinusoidal", "rope", "relative", "xl", "none")
NORMS = ("layernorm", "rmsnorm")
NORM_PLACEMENTS = ("pre", "post", "sandwich", "peri")
ACTIVATIONS = ("relu", "gelu", "gelu_tanh", "quick_gelu", "silu", "swiglu", "geglu", "geglu_tanh", "reglu")


@dataclass
class ModelConfig:
    """Hyper-parameters of a transformer; the defaults describe a small GPT-2-like decoder."""

    architecture: str = "decoder"          # decoder | encoder | encoder-decoder
    vocab_size: int = 512
    d_model: int = 256
    n_layers: int = 4
    n_heads: int = 4
    n_kv_heads: int | None = None          # None: = n_heads (MHA); 1: MQA; else GQA
    head_dim: int | None = None            # None: d_model // n_heads
    sliding_window: int | None = None      # causal attention to the last W positions only (Mistral, Mixtral)
    sliding_layers: list[int] | None = None  # the layers that slide when sliding_window is set, in increasing
                                           # order; None: every layer (Qwen2 mixes sliding and full layers)
    d_ff: int | None = None                # None: 4 d, or 2/3 * 4 d rounded up to 8 for gated FFNs
    max_seq_len: int = 256
    # positions
    position: str = "learned"              # learned | sinusoidal | rope | relative (T5) | xl (Transformer-XL) | none
    position_offset: int = 0               # BART: 2; RoBERTa: padding_idx + 1
    position_skip_padding: bool = False    # RoBERTa: positions count non-pad tokens only; pads get -1 (+ offset)
    sinusoidal_base: float = 10000.0
    rope_theta: float = 10000.0
    rope_scaling: dict | None = None       # {"type": "linear"|"ntk"|"dynamic"|"llama3"|"yarn", "factor": f, ...}
    rope_interleaved: bool = False         # False: rotate halves (HF LLaMA); True: adjacent pairs
    relative_buckets: int = 32             # T5 relative attention bias
    relative_max_distance: int = 128
    # Transformer-XL relative attention and memory (position "xl": XLNet)
    clamp_len: int = -1                    # relative distances clamped to [-clamp_len, clamp_len]; <= 0: not clamped
    same_length: bool = False              # causal ("decoder") XL attention: every query sees mem_len + 1 keys
    mem_len: int | None = None             # memory of past layer inputs kept across calls; None or 0: all of it
    reuse_len: int | None = None           # only the first reuse_len positions of a call enter the memory
    use_mems_eval: bool = True             # return the memory by default in eval mode (transformers' default)
    use_mems_train: bool = False           # ... and in training mode
    # normalization
    norm: str = "layernorm"                # layernorm | rmsnorm
    norm_placement: str = "pre"            # pre: x + F(LN(x)); post: LN(x + F(x)); sandwich: x + LN(F(x));
                                           # peri: x + LN'(F(LN(x))) (nn/blocks.py)
    norm_eps: float = 1e-5
    norm_bias: bool = True
    final_norm: bool = True                # a norm after the last block (pre-norm stacks)
    embedding_norm: bool = False           # LN right after the embeddings (BERT, BART)
    # feed-forward
    activation: str = "gelu"               # relu | gelu | gelu_tanh | quick_gelu | silu | swiglu | geglu | reglu
    bias: bool = True                      # biases of the linear layers
    attention_bias: bool | None = None     # None: = bias
    attention_out_bias: bool | None = None # o_proj's bias; None: = attention_bias (Qwen2: q/k/v biases, none here)
    mlp_bias: bool | None = None           # None: = bias
    # mixture of experts
    n_experts: int = 0                     # 0: dense FFN
    n_experts_per_token: int = 2
    expert_capacity_factor: float | None = None
    router_aux_loss_coef: float = 0.01
    router_jitter_noise: float = 0.0       # training: router inputs times U(1 - eps, 1 + eps) (Mixtral's jitter)
    output_router_logits: bool = False     # return the router logits and add the aux loss by default (config.json's)
    # embeddings and output
    tie_embeddings: bool = True
    separate_stack_embeddings: bool = False  # encoder-decoder: a token table per stack (BART untied in transformers 5)
    embedding_scale: float = 1.0           # multiply token embeddings (e.g. sqrt(d) for transformer-2017)
    output_scale: float = 1.0              # multiply hidden states before a tied LM head (T5: d^-0.5)
    output_bias: bool = False              # a (1, V) bias added to the logits (BART's final_logits_bias)
    attention_scale: float | None = None   # None: 1/sqrt(head_dim); T5: 1.0
    attention_scale_by_layer: bool = False  # layer i's scores also times 1/(i + 1) (GPT-2's scale_attn_by_inverse_layer_idx)
    type_vocab_size: int = 0               # segment embeddings (BERT: 2)
    # regularization and init
    dropout: float = 0.0                   # on the embeddings' sum and on each sub-layer's output
    attention_dropout: float = 0.0         # on the attention probabilities
    activation_dropout: float = 0.0        # inside the FFN, after the activation (T5: = dropout; BART's own setting)
    init_std: float = 0.02
    # encoder-decoder
    n_decoder_layers: int | None = None    # None: = n_layers
    decoder_start_token_id: int | None = None
    decoder_start_from_labels: bool = False  # mBART: teacher forcing starts from each row's last non-pad label
                                             # (its language code) instead of decoder_start_token_id
    # special tokens
    pad_token_id: int | None = None
    bos_token_id: int | None = None
    eos_token_id: int | None = None
    # the task head of an encoder or XLNet; what pruning and quantization changed (config_sections.py)
    task: TaskHead = field(default_factory=TaskHead)
    compression: Compression = field(default_factory=Compression)
    sparse: SparseAttention = field(default_factory=SparseAttention)  # Longformer's or BigBird's attention pattern
    # free-form: family name and HF settings that pass through untouched (label names, generation settings)
    family: str | None = None
    extra: dict[str, Any] = field(default_factory=dict)

    def __post_init__(self) -> None:
        self._absorb_extra()
        self.validate()

    def _absorb_extra(self) -> None:
        """Settings given in `extra` under their config.json keys (lmkit's own folders keep them there) move
        to their typed fields; what is left in `extra` passes through untouched."""
        for name, kind in (("task", TaskHead), ("compression", Compression), ("sparse", SparseAttention)):
            section = getattr(self, name)
            if isinstance(section, dict):
                unknown = sorted(set(section) - set(kind.keys()))
                if unknown:
                    raise ConfigError(f"unknown {name} settings: {', '.join(unknown)}; choose from {', '.join(kind.keys())}")
                section = kind(**section)
            given = {k: self.extra[k] for k in kind.keys() if k in self.extra}
            setattr(self, name, dataclasses.replace(section, **given) if given else section)
        for name in _FLAT_IN_EXTRA:
            if name in self.extra:
                setattr(self, name, self.extra[name])
        moved = set(TaskHead.keys()) | set(Compression.keys()) | set(SparseAttention.keys()) | set(_FLAT_IN_EXTRA)
        if moved & set(self.extra):
            self.extra = {k: v for k, v in self.extra.items() if k not in moved}

    # derived sizes ---------------------------------------------------------
    @property
    def resolved_n_kv_heads(self) -> int:
        """n_kv_heads with its default (None: one key/value head per query head) applied."""
        return self.n_kv_heads or self.n_heads

    @property
    def resolved_head_dim(self) -> int:
        """head_dim with its default (None: d_model // n_heads) applied."""
        return self.head_dim or self.d_model // self.n_heads

    @property
    def gated(self) -> bool:
        return self.activation in ("swiglu", "geglu", "geglu_tanh", "reglu")

    @property
    def resolved_d_ff(self) -> int:
        """d_ff with its default applied: 4 d, or for a gated FFN 2/3 of that rounded up to a multiple of 8."""
        if self.d_ff:
            return self.d_ff
        if self.gated:
            return 8 * -(-int(2 * 4 * self.d_model / 3) // 8)
        return 4 * self.d_model

    @property
    def decoder_layers(self) -> int:
        return self.n_decoder_layers if self.n_decoder_layers is not None else self.n_layers

    def layer_window(self, layer: int) -> int | None:
        """The window W that causal layer `layer` slides over (it sees keys j with i - W < j <= i), None for all keys."""
        if self.sliding_window is None or self.sliding_layers is not None and layer not in self.sliding_layers:
            return None
        return self.sliding_window

    @property
    def use_attention_bias(self) -> bool:
        return self.bias if self.attention_bias is None else self.attention_bias

    @property
    def use_attention_out_bias(self) -> bool:
        return self.use_attention_bias if self.attention_out_bias is None else self.attention_out_bias

    @property
    def use_mlp_bias(self) -> bool:
        return self.bias if self.mlp_bias is None else self.mlp_bias

    # checks and (de)serialization -----------------------------------------
    def validate(self) -> None:
        def choose(name: str, options: tuple) -> None:
            if getattr(self, name) not in options:
                raise ConfigError(f"{name}={getattr(self, name)!r} is not supported; choose one of {', '.join(options)}")

        check_types(self)
        choose("architecture", ARCHITECTURES)
        choose("position", POSITIONS)
        choose("norm", NORMS)
        choose("norm_placement", NORM_PLACEMENTS)
        choose("activation", ACTIVATIONS)
        for name in ("vocab_size", "d_model", "n_layers", "n_heads", "max_seq_len"):
            if int(getattr(self, name)) <= 0:
                raise ConfigError(f"{name} must be a positive integer, got {getattr(self, name)!r}")
        for name in ("n_kv_heads", "head_dim", "d_ff", "n_decoder_layers", "sliding_window"):
            if getattr(self, name) is not None and getattr(self, name) <= 0:
                raise ConfigError(f"{name} must be a positive integer or null, got {getattr(self, name)!r}")
        for name in ("position_offset", "n_experts", "type_vocab_size", "relative_buckets", "relative_max_distance"):
            if getattr(self, name) < 0:
                raise ConfigError(f"{name} must not be negative, got {getattr(self, name)!r}")
        for name in ("dropout", "attention_dropout", "activation_dropout"):
            if not 0.0 <= getattr(self, name) <= 1.0:
                raise ConfigError(f"{name} must lie in [0, 1], got {getattr(self, name)!r}")
        if self.head_dim is None and self.d_model % self.n_heads:
            raise ConfigError(f"d_model={self.d_model} is not divisible by n_heads={self.n_heads}; set head_dim or change one of them")
        if self.n_heads % self.resolved_n_kv_heads:
            raise ConfigError(f"n_heads={self.n_heads} must be a multiple of n_kv_heads={self.resolved_n_kv_heads}")
        if self.position == "rope" and self.resolved_head_dim % 2:
            raise ConfigError(f"RoPE needs an even head dimension, got {self.resolved_head_dim}")
        if self.sliding_layers is not None:
            layers = max(self.n_layers, self.decoder_layers)
            if self.sliding_window is None:
                raise ConfigError("sliding_layers needs sliding_window (the window those layers slide over); set it, "
                                  "or set sliding_layers to null")
            if self.sliding_layers != sorted(set(self.sliding_layers)) \
                    or not all(0 <= i < layers for i in self.sliding_layers):
                raise ConfigError(f"sliding_layers must list distinct layer indices in 0..{layers - 1} in increasing "
                                  f"order, got {self.sliding_layers!r}")
        if self.position == "xl" and self.d_model % 2:
            raise ConfigError(f"Transformer-XL positions (position 'xl') pair a sine and a cosine per frequency and need "
                              f"an even d_model, got {self.d_model}")
        if self.mem_len is not None and self.mem_len < 0 or self.reuse_len is not None and self.reuse_len < 0:
            raise ConfigError(f"mem_len and reuse_len must be 0 or more, or null; got {self.mem_len}, {self.reuse_len}")
        window = self.sparse.get("attention_window")
        if window is not None and len(window) != self.n_layers:
            raise ConfigError(f"attention_window lists {len(window)} windows for {self.n_layers} layers; give one per layer")
        if self.sparse.get("sparse_attention") is not None and self.architecture != "encoder":
            raise ConfigError("sparse attention (Longformer, BigBird) is built for encoders; set architecture='encoder'")
        if self.n_experts and not 1 <= self.n_experts_per_token <= self.n_experts:
            raise ConfigError(f"n_experts_per_token={self.n_experts_per_token} must lie in 1..n_experts={self.n_experts}")

    def to_dict(self) -> dict[str, Any]:
        """The fields as JSON values; the sections' given settings, and the flat ones that differ from their
        default, sit in `extra` under their config.json keys."""
        out = {f.name: getattr(self, f.name) for f in dataclasses.fields(self)
               if f.name not in ("task", "compression", "sparse") and f.name not in _FLAT_IN_EXTRA}
        extra = {**self.extra, **self.task.given(), **self.compression.given(), **self.sparse.given()}
        extra.update({name: getattr(self, name) for name, default in _FLAT_IN_EXTRA.items()
                      if getattr(self, name) != default})
        return copy.deepcopy({**out, "extra": extra})

    @classmethod
    def from_dict(cls, data: dict[str, Any]) -> "ModelConfig":
        names = {f.name for f in dataclasses.fields(cls)}
        unknown = sorted(set(data) - names)
        if unknown:
            raise ConfigError(f"unknown ModelConfig fields: {', '.join(unknown)}")
        return cls(**data)

    def replace(self, **changes: Any) -> "ModelConfig":
        return dataclasses.replace(self, **changes)

    def to_json(self) -> str:
        return json.dumps(self.to_dict(), indent=2, sort_keys=True)


# flat fields that lmkit's config.json writes inside `extra` (left out at their default, given here)
_FLAT_IN_EXTRA = {"router_jitter_noise": 0.0, "output_router_logits": False, "separate_stack_embeddings": False}

_GPT2 = dict(position="learned", norm="layernorm", norm_placement="pre", activation="gelu_tanh",
             tie_embeddings=True, bias=True, family="gpt2")
_LLAMA = dict(position="rope", norm="rmsnorm", norm_placement="pre", activation="swiglu", bias=False,
              norm_bias=False, tie_embeddings=False, norm_eps=1e-6, family="llama")

PRESETS: dict[str, dict[str, Any]] = {
    # decoder-only
    "tiny": dict(_GPT2, vocab_size=512, d_model=64, n_layers=2, n_heads=4, max_seq_len=128),
    # a small LLaMA (saved folders load in transformers); dropout 0.1 (embeddings and sub-layer outputs, none inside
    # the FFN) because Muon (the default recipe's optimizer) fits pydocs' 2.4 MB within the 5-minute budget: 2.01 bits
    # per byte with it, 2.05 without
    "default": dict(_LLAMA, vocab_size=4096, d_model=256, n_layers=4, n_heads=8, n_kv_heads=4, max_seq_len=128,
                    tie_embeddings=True, dropout=0.1),
    "gpt2": dict(_GPT2, vocab_size=50257, d_model=768, n_layers=12, n_heads=12, max_seq_len=1024),
    "llama": dict(_LLAMA, vocab_size=32000, d_model=2048, n_layers=16, n_heads=32, n_kv_heads=8, max_seq_len=2048,
                  rope_theta=500000.0),
    "transformer-2017": dict(position="sinusoidal", norm="layernorm", norm_placement="post", activation="relu",
                             vocab_size=37000, d_model=512, n_layers=6, n_heads=8, d_ff=2048, max_seq_len=512,
                             dropout=0.1, final_norm=False, embedding_scale=512 ** 0.5, family="transformer-2017"),
    # the 2017 Transformer as the paper trains it for translation: encoder-decoder, post-LN, ReLU, sinusoidal
    # positions, one token table shared by both stacks and tied to the output (scaled by sqrt(d) on the way in)
    "transformer-2017-mt": dict(architecture="encoder-decoder", position="sinusoidal", norm="layernorm",
                                norm_placement="post", activation="relu", vocab_size=37000, d_model=512, n_layers=6,
                                n_heads=8, d_ff=2048, max_seq_len=512, dropout=0.1, final_norm=False,
                                embedding_scale=512 ** 0.5, tie_embeddings=True, family="transformer-2017"),
    "moe": dict(_LLAMA, vocab_size=32000, d_model=512, n_layers=8, n_heads=8, n_kv_heads=2, max_seq_len=1024,
                n_experts=8, n_experts_per_token=2, family="mixtral"),
    # encoder-decoder (T5: relative buckets, pre-RMSNorm, unscaled scores, tied head scaled by d^-0.5; BART: post-norm)
    "t5": dict(architecture="encoder-decoder", position="relative", norm="rmsnorm", norm_bias=False, norm_eps=1e-6,
               bias=False, activation="relu", attention_scale=1.0, tie_embeddings=True, output_scale=512 ** -0.5,
               vocab_size=32128, d_model=512, n_layers=6, n_heads=8, head_dim=64, d_ff=2048, max_seq_len=512,
               dropout=0.1, activation_dropout=0.1, pad_token_id=0, eos_token_id=1, decoder_start_token_id=0,
               family="t5"),
    "bart": dict(architecture="encoder-decoder", position="learned", position_offset=2, norm_placement="post",
                 final_norm=False, embedding_norm=True, activation="gelu", output_bias=True, vocab_size=50265,
                 d_model=768, n_layers=6, n_heads=12, d_ff=3072, max_seq_len=1024, dropout=0.1,
                 attention_dropout=0.1, activation_dropout=0.1, pad_token_id=1, bos_token_id=0, eos_token_id=2, decoder_start_token_id=2,
                 family="bart"),
    "t5-tiny": dict(architecture="encoder-decoder", position="relative", norm="rmsnorm", norm_bias=False,
                    norm_eps=1e-6, bias=False, activation="relu", attention_scale=1.0, tie_embeddings=True,
                    output_scale=128 ** -0.5, vocab_size=2048, d_model=128, n_layers=3, n_heads=4, head_dim=32,
                    d_ff=512, max_seq_len=64, relative_max_distance=64, dropout=0.0, pad_token_id=0,
                    eos_token_id=1, family="t5"),  # decoder start: the pad token of the run's tokenizer
    # encoder-only (post-norm, LayerNorm after the embeddings, segment embeddings)
    "bert": dict(architecture="encoder", position="learned", norm_placement="post", embedding_norm=True,
                 final_norm=False, activation="gelu", norm_eps=1e-12, type_vocab_size=2, vocab_size=30522,
                 d_model=768, n_layers=12, n_heads=12, d_ff=3072, max_seq_len=512, dropout=0.1,
                 attention_dropout=0.1, pad_token_id=0, family="bert"),
    "roberta": dict(architecture="encoder", position="learned", norm_placement="post", embedding_norm=True,
                    final_norm=False, activation="gelu", norm_eps=1e-5, type_vocab_size=1, vocab_size=50265,
                    d_model=768, n_layers=12, n_heads=12, d_ff=3072, max_seq_len=512, position_offset=2,
                    position_skip_padding=True, dropout=0.1, attention_dropout=0.1, pad_token_id=1,
                    bos_token_id=0, eos_token_id=2, family="roberta"),
    "distilbert": dict(architecture="encoder", position="learned", norm_placement="post", embedding_norm=True,
                       final_norm=False, activation="gelu", norm_eps=1e-12, type_vocab_size=0, vocab_size=30522,
                       d_model=768, n_layers=6, n_heads=12, d_ff=3072, max_seq_len=512, dropout=0.1,
                       attention_dropout=0.1, pad_token_id=0, family="distilbert"),
}
# BERT at the size of Turc et al.'s BERT-Tiny (google/bert_uncased_L-2_H-128_A-2) with the vocabulary of the
# default preset (the run trains its own tokenizer): masked-LM pre-training in minutes on a CPU
PRESETS["bert-tiny"] = dict(PRESETS["bert"], vocab_size=4096, d_model=128, n_layers=2, n_heads=2, d_ff=512)
# XLNet at bert-tiny's size (post-norm, Transformer-XL relative attention with memory, two streams): permutation-LM
# pre-training (--objective plm) side by side with bert-tiny's masked LM
PRESETS["xlnet-tiny"] = dict(architecture="encoder", position="xl", norm_placement="post", final_norm=False,
                             activation="gelu", norm_eps=1e-12, attention_bias=False, vocab_size=4096, d_model=128,
                             n_layers=2, n_heads=2, d_ff=512, max_seq_len=128, mem_len=128, dropout=0.1,
                             attention_dropout=0.1, activation_dropout=0.1, family="xlnet", extra={"head": "lm"})
# Longformer at bert-tiny's size over 1024 tokens: RoBERTa's positions, a 64-token sliding window on every layer
# (global tokens where a task asks for them): masked-LM pre-training whose memory grows linearly with the length
PRESETS["longformer-tiny"] = dict(PRESETS["roberta"], vocab_size=4096, d_model=128, n_layers=2, n_heads=2, d_ff=512,
                                  max_seq_len=1024, family="longformer",
                                  sparse={"sparse_attention": "longformer", "attention_window": [64, 64]})


def get_preset(name: str, **overrides: Any) -> ModelConfig:
    """The named preset, with `overrides` applied on top."""
    if name not in PRESETS:
        raise ConfigError(f"unknown preset {name!r}; choose one of {', '.join(sorted(PRESETS))}")
    return ModelConfig(**{**PRESETS[name], **overrides})


def sliding_fields(window: int | None, slides: list[bool]) -> dict[str, Any]:
    """sliding_window and sliding_layers for layers where slides[i] says whether layer i slides over `window`,
    in the one spelling ModelConfig equality relies on: no window when no layer slides, sliding_layers None
    when every layer does."""
    layers = [i for i, s in enumerate(slides) if s]
    if window is None or not layers:
        return {"sliding_window": None, "sliding_layers": None}
    return {"sliding_window": window, "sliding_layers": None if len(layers) == len(slides) else layers}
