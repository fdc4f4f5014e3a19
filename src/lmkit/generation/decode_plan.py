"""A lean one-token decoding step for decoder-only models, used by `generate` after the prompt.

One new token per row runs through the same math as `CausalLM.forward` (embeddings, then per block
x + Attn(LN(x)) and x + FFN(LN(x)) or the post-/sandwich-norm forms, the final norm, the LM head),
but as a flat list of tensor operations on weights gathered (and, for models up to RELAYOUT_LIMIT
bytes, laid out for the CPU kernel that is fastest at the batch size) until they change: no module
calls, hooks or mask building per layer (each block's weights, norms and heads named in a `LayerPlan`). At
batch 1 the framework overhead of those calls was about half the time of a small model's step. A layer that slides over a window W (config.layer_window) attends
to the last W keys of the cache only: what the sliding mask k > i - W leaves of them, so the cache (every key)
and the logits stay those of full recomputation. Models with parts the plan does not cover (mixtures of
experts, relative position bias, any module that is not plain by `lmkit.nn.plain`: LoRA or quantized
projections, forward hooks, a subclass with its own forward) return None from `DecodePlan.build` and decode
through the modules.
"""
from __future__ import annotations

import dataclasses
import functools
import platform
import weakref
from typing import Callable, NamedTuple

import torch
import torch.nn.functional as F
from torch import nn

from lmkit.nn import Attention, Block, Embeddings, FeedForward, KVCache, LayerNorm, RMSNorm
from lmkit.nn.kernels.rms_norm import rms_norm
from lmkit.nn.plain import plain, unhooked
from lmkit.nn.positions import apply_rotary_factors, rotary_factors


@dataclasses.dataclass(frozen=True)
class Norm:
    """LayerNorm (x - mean) / sqrt(var + eps) * weight + bias, or RMSNorm x / sqrt(mean(x^2) + eps) * weight."""

    weight: torch.Tensor
    bias: torch.Tensor | None
    eps: float
    rms: bool

    @classmethod
    def of(cls, module: nn.Module | None) -> "Norm | None":
        if module is None:
            return None
        if isinstance(module, RMSNorm):
            return cls(module.weight, None, module.eps, True)
        return cls(module.weight, module.bias, module.eps, False)


def _apply_norm(norm: Norm | None, x: torch.Tensor) -> torch.Tensor:
    if norm is None:  # sandwich placement: no norm before F
        return x
    if norm.rms:
        return rms_norm(x, norm.weight, norm.eps)
    return F.layer_norm(x, (x.shape[-1],), norm.weight, norm.bias, norm.eps)


RELAYOUT_LIMIT = 1 << 28  # bytes of weights a plan may copy into faster layouts; bigger models use theirs as they are


class Projection(NamedTuple):
    """x W^T + b = function(x, *args), the kernel and the weights laid out for it (`projection`)."""

    function: Callable[..., torch.Tensor]
    args: tuple


def _addmm_t(x: torch.Tensor, weight_t: torch.Tensor, bias: torch.Tensor | None) -> torch.Tensor:
    return x @ weight_t if bias is None else torch.addmm(bias, x, weight_t)


def _split_matvec(x: torch.Tensor, weight_chunks: torch.Tensor, bias_chunks: torch.Tensor | None) -> torch.Tensor:
    """x W^T as n matrix products over n slices of the outputs, which torch runs on n threads (made for one row;
    a step checking drafted tokens gives it several)."""
    n, rows = weight_chunks.shape[0], x.shape[0]
    x = x.expand(n, rows, x.shape[-1])
    y = torch.bmm(x, weight_chunks) if bias_chunks is None else torch.baddbmm(bias_chunks, x, weight_chunks)
    return y.view(1, -1) if rows == 1 else y.transpose(0, 1).reshape(rows, -1)


def _onednn_linear(x: torch.Tensor, packed: torch.Tensor, bias: torch.Tensor | None) -> torch.Tensor:
    return torch.ops.mkldnn._linear_pointwise(x, packed, bias, "none", [], "")


def _onednn_usable() -> bool:
    return torch.backends.mkldnn.is_available() and hasattr(torch.ops.mkldnn, "_reorder_linear_weight")


@functools.cache
def intel_cpu() -> bool:
    """Whether the CPU is Intel's (/proc/cpuinfo's vendor_id, else what platform reports), where MKL runs its own
    kernels for small matrix products."""
    try:
        with open("/proc/cpuinfo", encoding="utf-8") as f:
            for line in f:
                if line.startswith("vendor_id"):
                    return "GenuineIntel" in line
    except OSError:
        pass
    return "intel" in platform.processor().lower()


MKL_SMALL_BATCH = 8  # most rows for which MKL's products beat oneDNN's packed ones on an Intel core
MKL_SMALL_WORK = 1 << 23  # multiply-adds (rows x in x out) up to which they do at any number of rows


def mkl_products(batch: int, weight: torch.Tensor) -> bool:
    """Whether MKL's product on W^T contiguous beats oneDNN's packed one for `batch` rows: on one thread of an Intel
    CPU, up to MKL_SMALL_BATCH rows, or a product of up to MKL_SMALL_WORK multiply-adds (oneDNN's call costs about
    20 us of its own: 16 rows times a 128 x 384 weight take 12 us in MKL, 31 us in oneDNN)."""
    return torch.get_num_threads() == 1 and intel_cpu() \
        and (batch <= MKL_SMALL_BATCH or batch * weight.numel() <= MKL_SMALL_WORK)


def projection(weight: torch.Tensor, bias: torch.Tensor | None, batch: int, relayout: bool) -> Projection:
    """x W^T + b for `batch` rows through the CPU kernel measured fastest for that case (bench/bench_decoder.py):
    one row on n > 1 threads: the outputs cut in n slices, one batched product (a matrix-vector product
    alone runs on one core, and at batch 1 the weights' memory traffic is the cost); one row on one
    thread, more outputs than inputs: W^T contiguous (MKL's gemv); several rows, float32 (no autocast, which
    the packed product would bypass): on one thread of an Intel CPU for small products (`mkl_products`), W^T
    contiguous (MKL's small products there take half the time of oneDNN's), else W packed for oneDNN's blocked
    matrix product (faster than MKL's on AMD's EPYC; docs/benchmarks.md); otherwise torch's linear on W as it is."""
    if not relayout or weight.device.type != "cpu":
        return Projection(F.linear, (weight, bias))
    n = torch.get_num_threads()
    out_features, in_features = weight.shape
    if batch == 1 and n > 1 and out_features % n == 0:
        chunks = weight.t().reshape(in_features, n, out_features // n).permute(1, 0, 2).contiguous()
        return Projection(_split_matvec, (chunks, None if bias is None else bias.detach().reshape(n, 1, -1)))
    if batch > 1 and weight.dtype == torch.float32 and not torch.is_autocast_enabled("cpu"):
        if mkl_products(batch, weight):
            return Projection(_addmm_t, (weight.t().contiguous(), bias))
        if _onednn_usable():
            packed = torch.ops.mkldnn._reorder_linear_weight(weight.contiguous(), batch)
            return Projection(_onednn_linear, (packed, bias))
    if weight.shape[0] > weight.shape[1]:
        return Projection(_addmm_t, (weight.t().contiguous(), bias))
    return Projection(F.linear, (weight, bias))


def _joined(*linears: nn.Linear) -> tuple[torch.Tensor, torch.Tensor | None]:
    """[W_1; W_2; ...] and the joined biases: several projections of one input as one matrix product."""
    weight = torch.cat([m.weight for m in linears]).detach()
    bias = torch.cat([m.bias for m in linears]).detach() if linears[0].bias is not None else None
    return weight, bias


@dataclasses.dataclass(frozen=True)
class LayerPlan:
    """One block of the plan: its attention (heads, kv_heads key/value heads of head_dim, GQA when fewer; scale
    None for 1/sqrt(head_dim); the last `window` keys when it slides), its four norm slots (`Residual.norm` and
    `.post_norm` of either sub-layer: before F, or after the sum for post-norm; None where the placement has none)
    and its projections: qkv = x [W_q; W_k; W_v]^T + b, o, then the FFN's gate_up = x [W_gate; W_up]^T + b (gated)
    or up, and down."""

    heads: int
    kv_heads: int
    head_dim: int
    scale: float | None
    window: int | None
    attn_norm: Norm | None
    attn_post_norm: Norm | None
    qkv: Projection
    o_proj: Projection
    mlp_norm: Norm | None
    mlp_post_norm: Norm | None
    gate_up: Projection | None
    up: Projection | None
    down: Projection


_PLANS: "weakref.WeakKeyDictionary[nn.Module, tuple]" = weakref.WeakKeyDictionary()  # model -> (key, plan)


def _layer_plan(block: Block, window: int | None, batch: int, relayout: bool) -> LayerPlan:
    attn, ffn = block.self_attn.sublayer, block.mlp.sublayer
    if relayout:
        qkv = projection(*_joined(attn.q_proj, attn.k_proj, attn.v_proj), batch, relayout)
    else:
        qkv = Projection(_addmm_t, attn.fused_qkv())
    gated = ffn.gate_proj is not None
    return LayerPlan(
        heads=attn.n_heads, kv_heads=attn.n_kv_heads, head_dim=attn.head_dim, scale=attn.scale, window=window,
        attn_norm=Norm.of(block.self_attn.norm), attn_post_norm=Norm.of(block.self_attn.post_norm), qkv=qkv,
        o_proj=projection(attn.o_proj.weight.detach(), attn.o_proj.bias, batch, relayout),
        mlp_norm=Norm.of(block.mlp.norm), mlp_post_norm=Norm.of(block.mlp.post_norm),
        gate_up=projection(*_joined(ffn.gate_proj, ffn.up_proj), batch, relayout) if gated else None,
        up=None if gated else projection(ffn.up_proj.weight.detach(), ffn.up_proj.bias, batch, relayout),
        down=projection(ffn.down_proj.weight.detach(), ffn.down_proj.bias, batch, relayout))


def _plain_block(block: nn.Module) -> bool:
    """A self-attention block the plan reproduces: plain Block, Attention, FeedForward (dense), norms and
    projections (`lmkit.nn.plain`), no cross-attention."""
    if not plain(block, Block) or block.cross_attn is not None:
        return False
    attn, ffn = block.self_attn.sublayer, block.mlp.sublayer
    if not plain(attn, Attention) or not plain(ffn, FeedForward):
        return False
    norms = (block.self_attn.norm, block.self_attn.post_norm, block.mlp.norm, block.mlp.post_norm)
    linears = (attn.q_proj, attn.k_proj, attn.v_proj, attn.o_proj, ffn.gate_proj, ffn.up_proj, ffn.down_proj)
    return all(m is None or plain(m, (LayerNorm, RMSNorm)) for m in norms) \
        and all(m is None or plain(m, nn.Linear) for m in linears)


class DecodePlan:
    """Weights of a decoder-only model gathered for `step`; `DecodePlan.build(model, batch)` makes one."""

    def __init__(self, model: nn.Module, batch: int):
        config = model.config
        stack = model.decoder
        relayout = sum(p.numel() * p.element_size() for p in model.parameters()) <= RELAYOUT_LIMIT
        self.embeddings = stack.embeddings
        self.rotary = stack.rotary
        self.interleaved = config.rope_interleaved
        self.placement = config.norm_placement
        self.final_norm = Norm.of(stack.norm)
        self.lm_head = projection(model.lm_head.weight.detach(), model.lm_head.bias, batch, relayout)
        self.output_scale = config.output_scale
        self.layers = [_layer_plan(block, config.layer_window(i), batch, relayout)
                       for i, block in enumerate(stack.layers)]
        # the FFNs' element-wise function as their kernels compute it (every block has the config's activation)
        self.act = stack.layers[0].mlp.sublayer.act if len(stack.layers) else None

    @classmethod
    def build(cls, model: nn.Module, batch: int) -> "DecodePlan | None":
        """The plan for `batch` rows, or None when the model has a part the plan does not reproduce exactly.

        `model` is a decoder-only model whose forward is its `decoder` stack's then `lm_head` (the model checks
        that its class keeps that forward: `CausalLM.decode_plan`); this checks every module below them with
        `lmkit.nn.plain`, and that no hook watches any of them. A model keeps its latest plan until its weights
        change (in place or replaced) or the batch size, thread count, autocast setting or sliding windows do."""
        config = model.config
        if model.training or config.architecture != "decoder" or config.n_experts:
            return None
        stack = model.decoder
        emb = stack.embeddings
        if stack.relative_bias is not None or emb.token_types is not None or not plain(emb, Embeddings) \
                or not plain(model.lm_head, nn.Linear):
            return None
        if not all(_plain_block(block) for block in stack.layers) or not unhooked(model):
            return None
        key = (batch, torch.get_num_threads(), torch.is_autocast_enabled("cpu"), torch.get_autocast_dtype("cpu"),
               config.sliding_window, tuple(config.sliding_layers or ()),
               tuple((p.data_ptr(), 0 if p.is_inference() else p._version) for p in model.parameters()))
        cached = _PLANS.get(model)
        if cached is None or cached[0] != key:
            cached = _PLANS[model] = (key, cls(model, batch))
        return cached[1]

    def step(self, tokens: torch.Tensor, cache: KVCache, position_ids: torch.Tensor,
             bias: torch.Tensor | None) -> torch.Tensor:
        """Logits (B, V) of the next token after `tokens` (B, 1) at `position_ids` (B, 1); appends to `cache`.
        With t > 1 tokens a row (drafted ones, checked at once) the logits after each, (B, t, V).

        `bias` is the boolean attention mask (B, 1, t, past + t) of padded batches (causal within the t new
        tokens), else None, which t > 1 does not take: the plan's own layers do not slide then either. It may also
        be a dict {window (None: full attention): mask} where the cache lays keys out per row (the serving engine's
        slots): a layer then takes its window's mask over every key instead of the cache's last W keys.
        """
        B, t = tokens.shape
        if t > 1 and bias is None:
            raise ValueError("a plan step over several tokens a row needs their mask (causal among them)")
        x = self.embeddings(tokens, position_ids=position_ids).reshape(B * t, -1)
        rope = None if self.rotary is None else rotary_factors(*self.rotary(position_ids, x.dtype), self.interleaved)
        pre = self.placement != "post"
        exact = x.dtype in _EXACT_DTYPES and not torch.is_autocast_enabled(x.device.type)
        masks = bias if isinstance(bias, dict) else None  # per window
        if exact and masks is not None:  # the boolean masks as the additive bias _attend_one adds, built once a step
            masks = {w: _additive(m, x.dtype) for w, m in masks.items()}
        elif exact and bias is not None:
            bias = _additive(bias, x.dtype)
        for i, layer in enumerate(self.layers):
            heads, kv_heads, head_dim = layer.heads, layer.kv_heads, layer.head_dim
            q_dim, kv_dim = heads * head_dim, kv_heads * head_dim
            h = _apply_norm(layer.attn_norm, x) if pre else x
            qk, v = layer.qkv.function(h, *layer.qkv.args).split((q_dim + kv_dim, kv_dim), dim=-1)
            if t == 1:
                qk = qk.view(B, heads + kv_heads, 1, head_dim)
                v = v.view(B, kv_heads, 1, head_dim)
            else:
                qk = qk.reshape(B, t, heads + kv_heads, head_dim).transpose(1, 2)
                v = v.reshape(B, t, kv_heads, head_dim).transpose(1, 2)
            if rope is not None:  # queries and keys rotated by the same angles: one rotation over both
                qk = apply_rotary_factors(qk, rope)
                if qk.dtype != v.dtype:  # as in Attention.forward: under autocast the rotation ran in float32
                    qk = qk.to(v.dtype)
            q, k = qk.split((heads, kv_heads), dim=1)
            k, v = cache.update(i, k, v)
            mask, window = bias, layer.window
            if masks is not None:  # the window's own mask over every key
                mask, window = masks[window], None
            if window is not None and k.shape[2] > window:  # the keys the sliding mask leaves: the last W
                k, v = k[:, :, -window:], v[:, :, -window:]
                mask = None if bias is None else bias[..., -window:]
            scale = head_dim ** -0.5 if layer.scale is None else layer.scale
            if exact:
                a = _attend_one(q, k, v, mask, scale) if t == 1 else _attend_few(q, k, v, mask, scale)
            else:
                a = F.scaled_dot_product_attention(q, k, v, attn_mask=mask, scale=layer.scale,
                                                   enable_gqa=kv_heads != heads)
            a = a.reshape(B, q_dim) if t == 1 else a.transpose(1, 2).reshape(B * t, q_dim)
            x = _residual(x, layer.o_proj.function(a, *layer.o_proj.args), layer.attn_norm, layer.attn_post_norm, pre)
            h = _apply_norm(layer.mlp_norm, x) if pre else x
            if layer.gate_up is None:
                h = self.act(layer.up.function(h, *layer.up.args))
            else:
                g, u = layer.gate_up.function(h, *layer.gate_up.args).chunk(2, dim=-1)
                h = self.act(g) * u
            x = _residual(x, layer.down.function(h, *layer.down.args), layer.mlp_norm, layer.mlp_post_norm, pre)
        if self.final_norm is not None:
            x = _apply_norm(self.final_norm, x)
        if self.output_scale != 1.0:
            x = x * self.output_scale
        logits = self.lm_head.function(x, *self.lm_head.args)
        return logits if t == 1 else logits.view(B, t, -1)


_EXACT_DTYPES = (torch.float32, torch.float64)  # where attention written as two products is as exact as SDPA's


def _additive(allowed: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
    """A boolean mask as the additive bias (0 where allowed, -inf where not)."""
    return torch.zeros(allowed.shape, dtype=dtype, device=allowed.device).masked_fill_(~allowed, float("-inf"))


def _attend_one(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, bias: torch.Tensor | None,
                scale: float) -> torch.Tensor:
    """softmax((q scale) K^T + bias) V for one query per row, q (B, H, 1, D) against k, v (B, KV, T, D): the
    H / KV query heads that share a key head are the rows of one product with its keys, so grouped keys are
    never repeated. `bias` (B, 1, 1, T) is additive (-inf where masked). SDPA's CPU kernel does the same work
    in query blocks, which for a single query costs more than the products themselves."""
    B, H, _, D = q.shape
    kv = k.shape[1]
    if kv == 0:  # every head of the layer pruned away
        return q
    scores = torch.matmul((q * scale).view(B, kv, H // kv, D), k.transpose(-1, -2))
    if bias is not None:
        scores.add_(bias)
    return torch.matmul(torch.softmax(scores, dim=-1), v).view(B, H, 1, D)


def _attend_few(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, bias: torch.Tensor,
                scale: float) -> torch.Tensor:
    """softmax((q scale) K^T + bias) V for t queries per row, q (B, H, t, D) against k, v (B, KV, T, D), the
    H / KV query heads of a key head as rows of one product as in `_attend_one`; `bias` (B, 1, t, T) additive."""
    B, H, t, D = q.shape
    kv = k.shape[1]
    if kv == 0:
        return q
    scores = torch.matmul((q * scale).reshape(B, kv, H // kv * t, D), k.transpose(-1, -2))
    scores = scores.view(B, kv, H // kv, t, -1).add_(bias[:, :, None])
    return torch.matmul(torch.softmax(scores, dim=-1).view(B, kv, H // kv * t, -1), v).view(B, H, t, D)


def _residual(x: torch.Tensor, f: torch.Tensor, norm: Norm | None, post_norm: Norm | None, pre: bool) -> torch.Tensor:
    """x + F (pre-norm), x + LN'(F) (sandwich, peri) or LN(x + F) (post-norm): the placements of
    nn.blocks.Residual on an F already computed (generation/test_decode_plan.py checks each against it)."""
    if not pre:
        return _apply_norm(norm, x + f)
    if post_norm is not None:
        f = _apply_norm(post_norm, f)
    return f.add_(x)
