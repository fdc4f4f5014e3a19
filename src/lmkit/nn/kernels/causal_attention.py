"""Causal attention for float32 training on CPU, as one compiled C++ kernel (`csrc/causal_attention.cpp`).

softmax(Q K^T * scale + causal mask) V, forward and backward, per (batch, head) with queries in blocks of
32 rows against their key prefix (the masked scores right of a block are never computed), the products in
MKL's sgemm. SDPA's flash kernel computes every key block of a query block at these lengths and moves q, k,
v and the output through head transposes; this kernel reads q, k and v where they lie (strided views of the
joined projection) and writes the output in the (batch, position, head) order the output projection takes.
softmax(Q K^T) is kept for the backward when it is small (T <= 4 x head size, 64 MB a call), which also lets
the backward form dK and dV one key block at a time over every query that sees it; otherwise it is recomputed
from the log-sum-exp. docs/portability.md compares it with SDPA.

The library is compiled on first use with g++ (or CXX) and OpenMP, running on torch's own OpenMP threads,
linked against libtorch_cpu for sgemm and cached under ~/.cache/lmkit (LMKIT_CACHE). Its numbers are checked
against the float64 formula before first use; without a compiler, without MKL's sgemm in libtorch_cpu, with
a kernel that fails the check, or with LMKIT_COMPILE_KERNELS=0, attention goes through SDPA.
"""
from __future__ import annotations

import ctypes
import hashlib
import logging
import os
import shutil
import subprocess
import tempfile
from pathlib import Path

import torch

from lmkit.nn.kernels.eager_attention import attention_probabilities
from lmkit.nn.kernels.guards import float32_cpu_training

# query rows per block, and key columns per block of the stored backward (the two must be equal): 32 and 64
# were within 2% forward + backward, 32 the faster (AVX2, T=256)
_BLOCK = 32
_SOURCE = Path(__file__).with_name("csrc") / "causal_attention.cpp"
_log = logging.getLogger(__name__)
_library: ctypes.CDLL | None | bool = None  # False once loading or checking failed


def _flags() -> list[str]:
    """Vector code where the CPU runs AVX2 (honouring ATEN_CPU_CAPABILITY, as ATen's own kernels do)."""
    vector = torch.backends.cpu.get_cpu_capability() in ("AVX2", "AVX512")
    return ["-O3", "-fopenmp", "-shared", "-fPIC", "-std=c++17"] + (["-mavx2", "-mfma"] if vector else [])


def _cache_dir() -> Path:
    root = os.environ.get("LMKIT_CACHE") or os.path.join(os.path.expanduser("~"), ".cache", "lmkit")
    return Path(root) / "kernels"


def _build() -> Path:
    """The compiled library, built once per source, flags and torch version (written atomically)."""
    compiler = os.environ.get("CXX") or shutil.which("g++") or shutil.which("c++")
    if not compiler:
        raise RuntimeError("no C++ compiler (g++ or c++ on PATH, or CXX)")
    torch_lib = Path(torch.__file__).parent / "lib"
    flags = _flags()
    key = hashlib.sha256(_SOURCE.read_bytes() + " ".join(flags + [compiler, torch.__version__]).encode()).hexdigest()
    target = _cache_dir() / f"causal_attention-{key[:16]}.so"
    if target.exists():
        return target
    target.parent.mkdir(parents=True, exist_ok=True)
    with tempfile.TemporaryDirectory(dir=target.parent) as tmp:
        built = Path(tmp) / target.name
        cmd = [compiler, *flags, str(_SOURCE), "-o", str(built), f"-L{torch_lib}", "-ltorch_cpu",
               f"-Wl,-rpath,{torch_lib}"]
        done = subprocess.run(cmd, capture_output=True, text=True)
        if done.returncode != 0:
            raise RuntimeError(f"compiling {_SOURCE.name} failed: {done.stderr.strip()[-2000:]}")
        os.replace(built, target)  # another process may have built the same file meanwhile: the same bytes
    return target


def _load() -> ctypes.CDLL:
    torch_cpu = ctypes.CDLL(str(Path(torch.__file__).parent / "lib" / "libtorch_cpu.so"))
    if not hasattr(torch_cpu, "sgemm_"):
        raise RuntimeError("libtorch_cpu has no sgemm_ (a torch build without MKL)")
    lib = ctypes.CDLL(str(_build()))
    i64, ptr, f32, i32 = ctypes.c_int64, ctypes.c_void_p, ctypes.c_float, ctypes.c_int
    lib.lmkit_causal_attention_forward.argtypes = [i64] * 5 + [ptr] * 10 + [f32, i64, i32]
    lib.lmkit_causal_attention_backward.argtypes = [i64] * 5 + [ptr] * 18 + [f32, i64, i32]
    return lib


def library() -> ctypes.CDLL | None:
    """The loaded kernel once it passed the check; None when it is unavailable here."""
    global _library
    if _library is None:
        _library = False
        if os.environ.get("LMKIT_COMPILE_KERNELS", "1") != "0":
            try:
                lib = _load()
                _library = lib
                _check()
            except Exception as err:
                _library = False
                _log.info("compiled causal attention unavailable (%s); using SDPA", err)
    return _library or None


def _strides(t: torch.Tensor) -> ctypes.Array:
    return (ctypes.c_int64 * 3)(*t.stride()[:3])


def _ptr(t: torch.Tensor | None) -> ctypes.c_void_p | None:
    return None if t is None else ctypes.c_void_p(t.data_ptr())


_STORE_LIMIT = 64 << 20  # bytes of kept probabilities per layer call, at most


def stores_probabilities(batch: int, heads: int, t: int, head_dim: int) -> bool:
    """Keep softmax(Q K^T) (T x T a head) for the backward while it is at most 4/3 of the heads' q, k and v
    (T <= 4 x head size: 256 positions at head size 64) and 64 MB a call; otherwise the backward recomputes it
    from the log-sum-exp."""
    return t <= 4 * head_dim and batch * heads * t * t * 4 <= _STORE_LIMIT


def attention_forward(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, scale: float,
                      store: bool | None = None) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor | None]:
    """(out (B, T, H, D) contiguous, log-sum-exp (B, H, T), stored probabilities or None) for q (B, H, T, D) and
    k, v (B, H_kv, T, D), each with unit stride along D."""
    lib = library()
    _validate(q, k, v)
    B, H, T, D = q.shape
    store = stores_probabilities(B, H, T, D) if store is None else store
    out = q.new_empty(B, T, H, D)
    lse = q.new_empty(B, H, T)
    probs = q.new_empty(B, H, T, T) if store else None  # only the causal triangle's blocks are written
    o = out.transpose(1, 2)
    lib.lmkit_causal_attention_forward(B, H, k.shape[1], T, D, _ptr(q), _strides(q), _ptr(k), _strides(k), _ptr(v),
                                       _strides(v), _ptr(o), _strides(o), _ptr(lse), _ptr(probs), scale, _BLOCK,
                                       torch.get_num_threads())
    return out, lse, probs


def _validate(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor) -> None:
    """What the kernel's pointer arithmetic assumes; anything else would read out of bounds."""
    shapes_ok = (q.dim() == k.dim() == v.dim() == 4 and k.shape == v.shape and q.shape[0] == k.shape[0]
                 and q.shape[2:] == k.shape[2:] and k.shape[1] > 0 and q.shape[1] % k.shape[1] == 0)
    if not shapes_ok or any(t.dtype != torch.float32 or t.device.type != "cpu" or t.stride(-1) != 1 for t in (q, k, v)):
        raise ValueError(f"causal attention kernel: q {tuple(q.shape)}, k {tuple(k.shape)}, v {tuple(v.shape)} "
                         "must be float32 CPU (B, H, T, D) / (B, H_kv, T, D) with unit stride along D")


def attention_backward(grad: torch.Tensor, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, out: torch.Tensor,
                       lse: torch.Tensor, probs: torch.Tensor | None, scale: float, dq: torch.Tensor,
                       dk: torch.Tensor, dv: torch.Tensor) -> None:
    """Write dq, dk, dv ((B, H, T, D) / (B, H_kv, T, D) views, unit stride along D) from grad (B, H, T, D)."""
    B, H, T, D = q.shape
    if grad.stride(-1) != 1:
        grad = grad.contiguous()
    o = out.transpose(1, 2)
    library().lmkit_causal_attention_backward(
        B, H, k.shape[1], T, D, _ptr(q), _strides(q), _ptr(k), _strides(k), _ptr(v), _strides(v), _ptr(o),
        _strides(o), _ptr(grad), _strides(grad), _ptr(lse), _ptr(probs), _ptr(dq), _strides(dq), _ptr(dk),
        _strides(dk), _ptr(dv), _strides(dv), scale, _BLOCK, torch.get_num_threads())


class CausalAttention(torch.autograd.Function):
    """q (B, H, T, D), k, v (B, H_kv, T, D) -> softmax(Q K^T * scale + causal mask) V as (B, H, T, D), a view
    of a (B, T, H, D) tensor (so merging the heads afterwards copies nothing)."""

    @staticmethod
    def forward(ctx, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, scale: float) -> torch.Tensor:
        out, lse, probs = attention_forward(q, k, v, scale)
        ctx.save_for_backward(q, k, v, out, lse, probs)
        ctx.scale = scale
        return out.transpose(1, 2)

    @staticmethod
    @torch.autograd.function.once_differentiable
    def backward(ctx, grad: torch.Tensor):
        q, k, v, out, lse, probs = ctx.saved_tensors
        dq, dk, dv = torch.empty_like(q), torch.empty_like(k), torch.empty_like(v)
        attention_backward(grad, q, k, v, out, lse, probs, ctx.scale, dq, dk, dv)
        return dq, dk, dv, None


def _split_heads(qkv: torch.Tensor, heads: int, kv_heads: int) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """(B, H, T, D) / (B, H_kv, T, D) views of q, k and v inside the joined (B, T, (H + 2 H_kv) D) projection."""
    B, T, width = qkv.shape
    D = width // (heads + 2 * kv_heads)
    q, k, v = qkv.split((heads * D, kv_heads * D, kv_heads * D), dim=-1)
    return (q.view(B, T, heads, D).transpose(1, 2), k.view(B, T, kv_heads, D).transpose(1, 2),
            v.view(B, T, kv_heads, D).transpose(1, 2))


class JoinedCausalAttention(torch.autograd.Function):
    """The joined q/k/v projection (B, T, (H + 2 H_kv) D) -> attention output (B, T, H D), heads merged. The
    gradient is one (B, T, (H + 2 H_kv) D) tensor, written in place by the kernel: no split, no concatenation."""

    @staticmethod
    def forward(ctx, qkv: torch.Tensor, heads: int, kv_heads: int, scale: float) -> torch.Tensor:
        q, k, v = _split_heads(qkv, heads, kv_heads)
        out, lse, probs = attention_forward(q, k, v, scale)
        ctx.save_for_backward(qkv, out, lse, probs)
        ctx.heads, ctx.kv_heads, ctx.scale = heads, kv_heads, scale
        return out.view(qkv.shape[0], qkv.shape[1], -1)

    @staticmethod
    @torch.autograd.function.once_differentiable
    def backward(ctx, grad: torch.Tensor):
        qkv, out, lse, probs = ctx.saved_tensors
        q, k, v = _split_heads(qkv, ctx.heads, ctx.kv_heads)
        d_qkv = torch.empty_like(qkv)
        dq, dk, dv = _split_heads(d_qkv, ctx.heads, ctx.kv_heads)
        B, T, H, D = out.shape
        attention_backward(grad.view(B, T, H, D).transpose(1, 2), q, k, v, out, lse, probs, ctx.scale, dq, dk, dv)
        return d_qkv, None, None, None


def applies(x: torch.Tensor) -> bool:
    """Whether the compiled kernel serves this call: float32 CPU training (eager.float32_cpu_training) on a
    non-empty tensor, with the kernel available."""
    return x.numel() > 0 and float32_cpu_training(x) and library() is not None


def _check() -> None:
    """Forward and backward against the float64 formula: grouped heads, a length that is no multiple of the block
    or of the vector width, both ways of feeding the backward, q/k/v as views of one joined projection."""
    def reference(q, k, v, scale):
        group = q.shape[1] // k.shape[1]
        probs = attention_probabilities(q, k.repeat_interleave(group, 1), None, True, scale)
        return probs @ v.repeat_interleave(group, 1)

    gen = torch.Generator().manual_seed(0)
    B, H, H_kv, T, D = 2, 4, 2, 2 * _BLOCK + 7, 12
    qkv = torch.randn(B, T, (H + 2 * H_kv) * D, generator=gen, dtype=torch.float64)
    grad = torch.randn(B, H, T, D, generator=gen, dtype=torch.float64)
    exact = qkv.clone().requires_grad_(True)
    q64, k64, v64 = _split_heads(exact, H, H_kv)
    reference(q64, k64, v64, 0.3).backward(grad)
    want_out = reference(*_split_heads(qkv, H, H_kv), 0.3)
    q, k, v = _split_heads(qkv.float(), H, H_kv)
    for store in (False, True):
        out, lse, probs = attention_forward(q, k, v, 0.3, store=store)
        d_qkv = torch.empty(qkv.shape)
        dq, dk, dv = _split_heads(d_qkv, H, H_kv)
        attention_backward(grad.float(), q, k, v, out, lse, probs, 0.3, dq, dk, dv)
        for got, want in ((out.transpose(1, 2), want_out), (d_qkv, exact.grad)):
            bound = 64 * torch.finfo(torch.float32).eps * want.abs().max()
            if not torch.isfinite(got).all() or (got.double() - want).abs().max() > bound:
                raise RuntimeError("the compiled attention's numbers differ from the formula's")
