"""torch.distributed for the trainer: the process group torchrun describes, DDP or FSDP, and collectives.

`torchrun --nproc-per-node N -m lmkit train ...` sets RANK, WORLD_SIZE, LOCAL_RANK, MASTER_ADDR/PORT;
`setup()` joins the group (NCCL on GPUs, gloo on CPU). The trainer's loss of a step is
sum over ranks of nats / sum over ranks of targets, so every rank's gradient is a share of one
global gradient and the shares must be *summed*, not averaged: DDP gets a comm hook that
all-reduces with SUM; FSDP a gradient divide factor of 1 (NCCL) or, on gloo, which lacks the
pre-multiplied sum that needs, a loss multiplied by N before its gradients are averaged.
"""
from __future__ import annotations

import contextlib
import datetime
import os
from dataclasses import dataclass
from typing import Any

import torch
import torch.distributed as dist
from torch import nn

from lmkit.errors import TrainingError, user_message


@dataclass
class DistContext:
    rank: int = 0
    world_size: int = 1
    local_rank: int = 0
    device: torch.device = torch.device("cpu")
    backend: str | None = None

    @property
    def is_main(self) -> bool:
        return self.rank == 0


def setup(device: str | torch.device | None = None) -> DistContext:
    """The process group from torchrun's environment; one process (no group) when WORLD_SIZE is unset or 1.
    Under torchrun a CUDA `device` (None: CUDA when there is one) means this rank's GPU, cuda:LOCAL_RANK."""
    world = int(os.environ.get("WORLD_SIZE", "1"))
    if world <= 1:
        return DistContext(device=torch.device(device or "cpu"))
    rank, local = int(os.environ["RANK"]), int(os.environ.get("LOCAL_RANK", "0"))
    use_cuda = str(device or ("cuda" if torch.cuda.is_available() else "cpu")).startswith("cuda")
    backend = "nccl" if use_cuda else "gloo"
    if use_cuda:
        if torch.cuda.device_count() <= local:
            raise TrainingError(f"LOCAL_RANK {local} has no GPU ({torch.cuda.device_count()} visible); "
                                "use --nproc-per-node at most the number of GPUs")
        torch.cuda.set_device(local)
        dev = torch.device("cuda", local)
    else:
        dev = torch.device("cpu")
    if not dist.is_initialized():
        dist.init_process_group(backend, timeout=datetime.timedelta(minutes=30))
    return DistContext(rank, world, local, dev, backend)


def teardown(ctx: DistContext, finished: bool = True) -> None:
    """After a finished run, or a set-up failure every rank agreed on, every rank waits for the others (rank 0 may
    still be writing), then the group goes: a rank that left while a peer still used the group could abort in
    gloo's threads (SIGABRT instead of exit 2). After another error the group is left to the process's exit (a peer
    may be stuck in a collective: destroying would hang)."""
    if ctx.world_size > 1 and dist.is_initialized() and finished:
        dist.barrier()
        dist.destroy_process_group()


class SetupFailed(TrainingError):
    """Set-up failed on some rank: every rank raises this, with one report (the CLI prints rank 0's)."""


@contextlib.contextmanager
def agree_on_setup(ctx: DistContext):
    """Run a set-up block on every rank, then let every rank learn whether it succeeded on all of them (an all_reduce
    of a failure flag), so that a rank > 0 failing alone (its own file system) does not leave the others waiting in
    the next collective until the group's timeout. When any failed, every rank raises SetupFailed(failure_report(...));
    a rank's own bug is re-raised there, with its traceback. The block must not itself start a collective, but
    for a nested agree_on_setup: what that one agreed on passes the outer one untouched."""
    if ctx.world_size <= 1:
        yield
        return
    try:
        yield
    except SetupFailed:
        raise  # an inner block has agreed already
    except Exception as exc:
        if getattr(exc, "_lmkit_agreed", False):  # a bug an inner block agreed on: the other ranks raised SetupFailed
            raise
        message = user_message(exc)
        report = _agree(ctx, message or f"{type(exc).__name__}: {exc} (a bug: see that rank's traceback)")
        if message is None:
            with contextlib.suppress(AttributeError):  # an exception type without attributes of its own
                exc._lmkit_agreed = True
            raise
        raise SetupFailed(report) from None
    report = _agree(ctx, None)
    if report is not None:
        raise SetupFailed(report)


def run_ranks(ctx: DistContext, body) -> tuple[Any, int]:
    """(body(), 0) on every rank of a command, with the group torn down after: a set-up failure every rank agreed on
    is raised on rank 0 (one line, printed once) and gives (None, 2) on the others; any other error is raised on the
    rank that had it."""
    finished = agreed = False  # agreed: every rank knows of the set-up failure, so none is inside a collective
    try:
        result = body()
        finished = True
        return result, 0
    except SetupFailed:
        agreed = True
        if ctx.is_main:
            raise
        return None, 2
    except Exception as exc:
        agreed = getattr(exc, "_lmkit_agreed", False)  # a rank's own bug the others raised SetupFailed for
        raise
    finally:
        teardown(ctx, finished or agreed)


def _agree(ctx: DistContext, message: str | None) -> str | None:
    """None when no rank failed (message None on every rank), else the report of every rank's message."""
    flag = torch.tensor([float(message is not None)], device=ctx.device if ctx.backend == "nccl" else "cpu")
    dist.all_reduce(flag)
    return None if flag.item() == 0 else failure_report(gather_objects(message, ctx))


def failure_report(messages: list[str | None]) -> str:
    """One line from the set-up messages of ranks 0..N-1 (None: that rank succeeded): a message every rank gave
    alike as it is (a bad flag fails everywhere), otherwise each failing rank's, prefixed with its rank."""
    if None not in messages and len(set(messages)) == 1:
        return messages[0]
    ranks: dict[str, list[int]] = {}
    for rank, message in enumerate(messages):
        if message is not None:
            ranks.setdefault(message, []).append(rank)
    return "; ".join(f"rank{'s' * (len(r) > 1)} {', '.join(map(str, r))}: {m}" for m, r in ranks.items())


def _sum_hook(state, bucket):  # no annotations: DDP checks them, and this module's are strings
    """All-reduce a gradient bucket with SUM (DDP's default hook divides by the world size)."""
    return dist.all_reduce(bucket.buffer(), async_op=True).get_future().then(lambda fut: fut.value()[0])


def wrap_model(model: nn.Module, ctx: DistContext, fsdp: bool = False) -> nn.Module:
    """The module the training step calls: the model itself (one process), DDP, or FSDP (sharded in place)."""
    if ctx.world_size <= 1:
        return model
    if fsdp:
        from torch.distributed.device_mesh import init_device_mesh
        from torch.distributed.fsdp import fully_shard

        mesh = init_device_mesh(ctx.device.type, (ctx.world_size,))
        for module in model.modules():  # one FSDP unit per transformer block, the rest in the root
            if type(module).__name__ == "Block":
                fully_shard(module, mesh=mesh)
        fully_shard(model, mesh=mesh)
        if ctx.backend == "nccl":
            model.set_gradient_divide_factor(1.0)  # gloo lacks the PREMUL_SUM this needs: see loss_scale
        return model
    from torch.nn.parallel import DistributedDataParallel as DDP

    ids = [ctx.device.index] if ctx.device.type == "cuda" else None
    cfg = getattr(model, "config", None)
    # routed experts and heads an objective leaves out (an encoder's pooler) get no gradient in some steps
    unused = bool(getattr(cfg, "n_experts", 0)) or getattr(cfg, "architecture", "decoder") == "encoder"
    ddp = DDP(model, device_ids=ids, find_unused_parameters=unused, **_no_buffer_sync())
    ddp.register_comm_hook(None, _sum_hook)
    return ddp


def loss_scale(ctx: DistContext, fsdp: bool) -> float:
    """What the step's loss is multiplied by so that averaged gradients come out summed (FSDP on gloo)."""
    return float(ctx.world_size) if fsdp and ctx.world_size > 1 and ctx.backend != "nccl" else 1.0


def _no_buffer_sync() -> dict[str, bool]:
    """Buffers (RoPE tables) are built identically on every rank: no need to broadcast them each forward."""
    import inspect

    from torch.nn.parallel import DistributedDataParallel as DDP

    params = inspect.signature(DDP.__init__).parameters
    return {"forward_sync_buffers": False} if "forward_sync_buffers" in params else {"broadcast_buffers": False}


def no_sync(engine: nn.Module, skip: bool):
    """Accumulate gradients locally (no all-reduce) for every micro batch but the step's last one."""
    if skip and hasattr(engine, "no_sync"):
        return engine.no_sync()
    if skip and hasattr(engine, "set_requires_gradient_sync"):
        engine.set_requires_gradient_sync(False)
        return _ResetSync(engine)
    if hasattr(engine, "set_requires_gradient_sync"):
        engine.set_requires_gradient_sync(True)
    return contextlib.nullcontext()


class _ResetSync(contextlib.AbstractContextManager):
    def __init__(self, engine: nn.Module):
        self.engine = engine

    def __exit__(self, *exc: Any) -> None:
        self.engine.set_requires_gradient_sync(True)


def all_reduce_sum(value: torch.Tensor, ctx: DistContext) -> torch.Tensor:
    if ctx.world_size > 1:
        on = value.to(ctx.device) if ctx.backend == "nccl" else value
        dist.all_reduce(on)
        value.copy_(on)
    return value


def broadcast_float(value: float, ctx: DistContext) -> float:
    """Rank 0's value on every rank (decisions from local clocks: the planned step count, time is up)."""
    if ctx.world_size <= 1:
        return value
    t = torch.tensor([float(value)], dtype=torch.float64, device=ctx.device if ctx.backend == "nccl" else "cpu")
    dist.broadcast(t, 0)
    return float(t.item())


def gather_objects(obj: Any, ctx: DistContext) -> list[Any]:
    """[obj of rank 0, obj of rank 1, ...] on every rank (JSON-able values, e.g. RNG states)."""
    if ctx.world_size <= 1:
        return [obj]
    out: list[Any] = [None] * ctx.world_size
    dist.all_gather_object(out, obj)
    return out


def full_state_dicts(model: nn.Module, optimizer: torch.optim.Optimizer, ctx: DistContext,
                     fsdp: bool) -> tuple[dict[str, torch.Tensor], dict]:
    """(model, optimizer) state dicts as one process would hold them; collective under FSDP."""
    if not fsdp or ctx.world_size <= 1:
        return model.state_dict(), optimizer.state_dict()
    from torch.distributed.checkpoint.state_dict import StateDictOptions, get_model_state_dict, get_optimizer_state_dict

    options = StateDictOptions(full_state_dict=True, cpu_offload=True)
    # gathered tensors are copies, so tied weights no longer share storage: keep one name, as one process saves
    aliases = {n for n, _ in model.named_parameters(remove_duplicate=False)} - {n for n, _ in model.named_parameters()}
    model_sd = {k: v for k, v in get_model_state_dict(model, options=options).items() if k not in aliases}
    optim_sd = get_optimizer_state_dict(model, optimizer, options=StateDictOptions(full_state_dict=True, cpu_offload=True,
                                                                                   flatten_optimizer_state_dict=False))
    return model_sd, _indexed_optimizer_state(model, optimizer, optim_sd)


def _indexed_optimizer_state(model: nn.Module, optimizer: torch.optim.Optimizer, sd: dict) -> dict:
    """An optimizer state dict keyed by FQN turned into torch's usual integer ids (parameter order)."""
    if "state" not in sd:  # ranks other than 0 receive nothing with cpu_offload
        return sd
    names = {id(p): n for n, p in model.named_parameters()}
    order = [names[id(p)] for g in optimizer.param_groups for p in g["params"]]
    index = {n: i for i, n in enumerate(order)}
    state = {index[k]: v for k, v in sd["state"].items()}
    groups = [{**{k: v for k, v in g.items() if k != "params"}, "params": [index[n] for n in g["params"]]}
              for g in sd["param_groups"]]
    return {"state": state, "param_groups": groups}


def load_full_state_dicts(model: nn.Module, optimizer: torch.optim.Optimizer, model_sd: dict, optim_sd: dict) -> None:
    """Load one-process state dicts into an FSDP model and its optimizer (every rank holds the full dicts)."""
    from torch.distributed.checkpoint.state_dict import StateDictOptions, set_model_state_dict, set_optimizer_state_dict

    options = StateDictOptions(full_state_dict=True)
    set_model_state_dict(model, model_sd, options=options)
    order = {id(p): n for n, p in model.named_parameters()}
    flat = [order[id(p)] for g in optimizer.param_groups for p in g["params"]]
    by_name = {"state": {flat[int(i)]: v for i, v in optim_sd["state"].items()},
               "param_groups": [{**{k: v for k, v in g.items() if k != "params"}, "params": [flat[i] for i in g["params"]]}
                                for g in optim_sd["param_groups"]]}
    set_optimizer_state_dict(model, optimizer, by_name, options=options)
