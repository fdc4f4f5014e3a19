"""Muon for the hidden weight matrices of a transformer, AdamW for everything else: one optimizer, one state.

Muon (Jordan et al., 2024), for a matrix W (A x B) with gradient g:
  B_t = mu B_{t-1} + (1 - mu) g_t,   U_t = (1 - mu) g_t + mu B_t   (Nesterov momentum)
  O_t = NS_5(U_t / ||U_t||_F) ~ U V^T of U_t's SVD                 (quintic Newton-Schulz)
  W_t = (1 - lr wd) W_{t-1} - lr 0.2 sqrt(max(A, B)) O_t
The factor 0.2 sqrt(max(A, B)) gives the update the RMS of an AdamW update (Moonlight, Liu et al. 2025), so one
learning rate and schedule serve both parts. Embedding tables, the output head, norm gains and biases keep AdamW
(decay on matrices only, as `optim.param_groups`). Equal to torch.optim.Muon(adjust_lr_fn="match_rms_adamw") plus
torch.optim.AdamW (tested); under FSDP each rank gathers the whole matrix to orthogonalize it.
Newton-Schulz runs in bf16 (as torch's Muon) where the CPU multiplies bf16 natively, else in fp32: emulated bf16
matrix products are slower than fp32 ones there, and fp32 is at least as accurate.
"""
from __future__ import annotations

import math

import torch
from torch import nn

from lmkit.train.param_groups import param_groups
from lmkit.train.precision import bf16_supported

NS_COEFFICIENTS = (3.4445, -4.7750, 2.0315)


def hidden_matrices(model: nn.Module) -> list[nn.Parameter]:
    """The weight matrices of the linear layers inside the layer stacks (not embeddings, heads or classifiers)."""
    out, seen = [], set()
    for name, module in model.named_modules():
        if isinstance(module, nn.Linear) and ".layers." in f".{name}" and module.weight.requires_grad \
                and id(module.weight) not in seen:
            seen.add(id(module.weight))
            out.append(module.weight)
    return out


def newton_schulz_dtype(device: torch.device | str = "cpu") -> torch.dtype:
    """bf16 on accelerators and on CPUs with native bf16 matrix products; fp32 on the others."""
    return torch.bfloat16 if torch.device(device).type != "cpu" or bf16_supported() else torch.float32


def newton_schulz(g: torch.Tensor, steps: int = 5, eps: float = 1e-7, dtype: torch.dtype | None = None) -> torch.Tensor:
    """An approximation of U V^T (g = U S V^T) by the quintic iteration X <- a X + (b A + c A^2) X, A = X X^T,
    in `dtype` (None: `newton_schulz_dtype`)."""
    a, b, c = NS_COEFFICIENTS
    x = g.to(dtype or newton_schulz_dtype(g.device))
    if g.size(0) > g.size(1):
        x = x.T
    x = x.div(x.norm().clamp(min=eps))
    for _ in range(steps):
        gram = x @ x.T
        x = torch.addmm(x, torch.addmm(gram, gram, gram, beta=b, alpha=c), x, beta=a)
    return x.T if g.size(0) > g.size(1) else x


def _orthogonalized(u: torch.Tensor, steps: int, dtype: torch.dtype | None) -> torch.Tensor:
    if hasattr(u, "full_tensor"):  # an FSDP shard (DTensor): orthogonalize the whole matrix, keep this rank's part
        from torch.distributed.tensor import distribute_tensor

        return distribute_tensor(newton_schulz(u.full_tensor(), steps, dtype=dtype), u.device_mesh, u.placements,
                                 src_data_rank=None)
    return newton_schulz(u, steps, dtype=dtype)


class MuonAdamW(torch.optim.Optimizer):
    """Muon on `hidden_matrices(model)`, AdamW on the other parameters; groups carry `muon: True/False`.
    ns_dtype: the precision of Newton-Schulz (None: `newton_schulz_dtype`)."""

    def __init__(self, model: nn.Module, lr: float, weight_decay: float = 0.1,
                 betas: tuple[float, float] = (0.9, 0.95), eps: float = 1e-8, momentum: float = 0.95,
                 ns_steps: int = 5, ns_dtype: torch.dtype | None = None):
        # an attribute, not a group setting: optimizer state is saved as JSON, which has no dtype
        self.ns_dtype = ns_dtype

        hidden = hidden_matrices(model)
        groups = [{"params": hidden, "weight_decay": weight_decay, "muon": True}]
        groups += [{**g, "muon": False} for g in param_groups(model, weight_decay, skip={id(p) for p in hidden})]
        super().__init__([g for g in groups if g["params"]],
                         dict(lr=lr, betas=betas, eps=eps, momentum=momentum, ns_steps=ns_steps))

    @torch.no_grad()
    def step(self, closure=None):
        loss = None
        if closure is not None:
            with torch.enable_grad():
                loss = closure()
        for group in self.param_groups:
            for p in group["params"]:
                if p.grad is not None:
                    if group["muon"]:
                        self._muon(p, p.grad, self.state[p], group, self.ns_dtype)
                    else:
                        self._adamw(p, p.grad, self.state[p], group)
        return loss

    @staticmethod
    def _muon(p: torch.Tensor, g: torch.Tensor, state: dict, group: dict, ns_dtype: torch.dtype | None) -> None:
        mu, lr = group["momentum"], group["lr"]
        buf = state.setdefault("momentum_buffer", torch.zeros_like(g))
        buf.lerp_(g, 1 - mu)
        update = _orthogonalized(g.lerp(buf, mu), group["ns_steps"], ns_dtype)
        p.mul_(1 - lr * group["weight_decay"])
        p.add_(update.to(p.dtype), alpha=-lr * 0.2 * math.sqrt(max(p.shape[0], p.shape[1])))

    @staticmethod
    def _adamw(p: torch.Tensor, g: torch.Tensor, state: dict, group: dict) -> None:
        """W <- (1 - lr wd) W - lr m_hat / (sqrt(v_hat) + eps), m and v the bias-corrected moment estimates."""
        (b1, b2), lr = group["betas"], group["lr"]
        if not state:
            state.update(step=torch.zeros((), dtype=torch.float32), exp_avg=torch.zeros_like(p),
                         exp_avg_sq=torch.zeros_like(p))
        state["step"] += 1
        t = state["step"].item()
        p.mul_(1 - lr * group["weight_decay"])
        state["exp_avg"].lerp_(g, 1 - b1)
        state["exp_avg_sq"].mul_(b2).addcmul_(g, g, value=1 - b2)
        denom = (state["exp_avg_sq"].sqrt() / math.sqrt(1 - b2 ** t)).add_(group["eps"])
        p.addcdiv_(state["exp_avg"], denom, value=-lr / (1 - b1 ** t))
