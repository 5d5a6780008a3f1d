"""Every collective hybridtrain calls itself, on the device the backend needs.

NCCL reduces and gathers only CUDA tensors of the rank's own device; gloo takes CPU tensors. A
tensor that enters a collective on the wrong device (a checkpoint tensor already copied to the
host, ``torch.nn.utils.get_total_norm([])``, which torch returns on the CPU) crashes only on a GPU
job: the CPU suite on gloo cannot see it. So the rule lives here, in one place: the caller names
the device the collective runs on (the engine's device, :func:`comm_device` without an engine),
a tensor elsewhere is copied there first, and the result comes back on that device; callers move
it to the host afterwards. ``tests/unit/test_collectives.py`` fails when ``hybridtrain`` calls a
``torch.distributed`` collective anywhere else.

Not covered, because not ours: DeepSpeed's collectives (ZeRO, the pipeline's sends, the tensor-
parallel layers of ``deepspeed.module_inject``, whose inputs are activations on the device) and
the link probe of :mod:`hybridtrain.plan.calibrate` (its own process group, tensors made on
``cuda:rank``).
"""
from __future__ import annotations

from typing import Any

import torch
import torch.distributed as dist

_OPS = {"sum": dist.ReduceOp.SUM, "max": dist.ReduceOp.MAX, "min": dist.ReduceOp.MIN}


def comm_device() -> torch.device:
    """The device the default process group communicates on: the current CUDA device under NCCL,
    else the CPU (gloo, or no process group)."""
    if dist.is_initialized() and dist.get_backend() == "nccl":
        return torch.device("cuda", torch.cuda.current_device())
    return torch.device("cpu")


def on_device(tensor: torch.Tensor, device: Any) -> torch.Tensor:
    """``tensor`` on ``device`` (itself when it is there already), contiguous, as collectives want."""
    return tensor.to(device).contiguous()


def _world(group: Any) -> int:
    return dist.get_world_size(group) if dist.is_initialized() else 1


def all_reduce(tensor: torch.Tensor, device: Any, op: str = "sum", group: Any = None) -> torch.Tensor:
    """``op`` (``sum``, ``max``, ``min``) of ``tensor`` over ``group``, on ``device``; the input is
    reduced in place when it is on ``device`` already. Without a process group (or in a group of
    one) the tensor is returned on ``device`` unchanged."""
    out = on_device(tensor, device)
    if _world(group) > 1:
        dist.all_reduce(out, op=_OPS[op], group=group)
    return out


def send(tensor: torch.Tensor, group: Any, peer: int) -> None:
    """Point-to-point: ``tensor`` (made contiguous) to rank ``peer`` of ``group`` (its place in the group)."""
    dist.send(tensor.contiguous(), dst=dist.get_global_rank(group, peer), group=group)


def recv(like: torch.Tensor, group: Any, peer: int) -> torch.Tensor:
    """Point-to-point: a tensor shaped and typed as ``like`` from rank ``peer`` of ``group``."""
    out = torch.empty_like(like, memory_format=torch.contiguous_format)
    dist.recv(out, src=dist.get_global_rank(group, peer), group=group)
    return out


def all_gather(tensor: torch.Tensor, device: Any, group: Any = None) -> list[torch.Tensor]:
    """Every rank's ``tensor`` (same shape and dtype on every rank) in group-rank order, on ``device``."""
    local = on_device(tensor, device)
    n = _world(group)
    if n == 1:
        return [local]
    out = [torch.empty_like(local) for _ in range(n)]
    dist.all_gather(out, local, group=group)
    return out


def gather(tensor: torch.Tensor, device: Any, group: Any = None) -> list[torch.Tensor] | None:
    """Every rank's ``tensor`` (same shape and dtype on every rank) in group-rank order, on ``device``,
    at the group's first rank only (``None`` on the others, which keep no copy): the receiving rank
    alone holds the whole, where :func:`all_gather` gives it to every rank."""
    local = on_device(tensor, device)
    n = _world(group)
    if n == 1:
        return [local]
    if dist.get_rank(group) != 0:
        dist.gather(local, None, group=group, group_dst=0)
        return None
    out = [torch.empty_like(local) for _ in range(n)]
    dist.gather(local, out, group=group, group_dst=0)
    return out


def barrier(device: Any = None, group: Any = None) -> None:
    """Wait until every rank of ``group`` arrives (a no-op without a process group). On a CUDA
    ``device`` NCCL synchronises on that device, never on a guessed one (torch's default)."""
    if not dist.is_initialized():
        return
    device = torch.device(device) if device is not None else comm_device()
    if device.type == "cuda":
        dist.barrier(group=group, device_ids=[device.index if device.index is not None else torch.cuda.current_device()])
    else:
        dist.barrier(group=group)


def all_to_all_counts(counts: torch.Tensor, group: Any) -> torch.Tensor:
    """Exchange one count per rank of ``group`` (``counts[j]``: what this rank sends rank ``j``); returns what
    each rank sends this one, on ``counts``' device (an expert-parallel dispatch's split sizes)."""
    out = torch.empty_like(counts)
    dist.all_to_all_single(out, counts.contiguous(), group=group)
    return out


class _AllToAll(torch.autograd.Function):
    """``all_to_all_single`` of rows with uneven (possibly empty) splits, differentiable: the backward sends
    the gradients back the way the rows came (the splits swapped). Written here because torch's public
    autograd wrapper (``torch.distributed.nn.functional.all_to_all_single``) is deprecated and the
    functional-collectives one is private."""

    @staticmethod
    def forward(ctx, rows, out_splits, in_splits, group):
        ctx.splits, ctx.group = (out_splits, in_splits), group
        out = rows.new_empty((sum(out_splits), *rows.shape[1:]))
        dist.all_to_all_single(out, rows.contiguous(), out_splits, in_splits, group=group)
        return out

    @staticmethod
    def backward(ctx, grad):
        out_splits, in_splits = ctx.splits
        back = grad.new_empty((sum(in_splits), *grad.shape[1:]))
        dist.all_to_all_single(back, grad.contiguous(), in_splits, out_splits, group=ctx.group)
        return back, None, None, None


def all_to_all_rows(rows: torch.Tensor, out_splits: list[int], in_splits: list[int], group: Any) -> torch.Tensor:
    """Send ``rows`` ``[sum(in_splits), ...]`` (``in_splits[j]`` rows to rank ``j`` of ``group``, in rank order)
    and receive ``[sum(out_splits), ...]``; autograd sends the gradients back (:class:`_AllToAll`)."""
    return _AllToAll.apply(rows, list(out_splits), list(in_splits), group)


class _AllGather(torch.autograd.Function):
    """``all_gather`` of equal tensors into one ``[world, ...]`` buffer, differentiable: the backward
    reduce-scatters the gradients of the gathered copies, so each rank gets the sum of every rank's gradient
    of its own piece.

    Written here because torch's autograd wrapper (``torch.distributed.nn.functional.all_gather``) is
    deprecated in torch 2.13 (a ``FutureWarning`` per call) and, on gloo, its backward emulates the
    reduce-scatter with one ``dist.scatter`` per member passing the *group* rank as the *global* source:
    on a group that is not ranks ``0..n-1`` (a cp group at tp > 1) it raises "Global rank 1 is not part of
    group". The single-tensor collectives (not the list ones, which NCCL runs through a flat buffer of its
    own and copies out of: two more copies of K and V per layer, gpu-review-3 finding 14) run on gloo and
    NCCL alike (checked on gloo, torch 2.13)."""

    @staticmethod
    def forward(ctx, tensor, group):
        ctx.group, ctx.shape = group, tensor.shape
        out = tensor.new_empty((_world(group) * tensor.numel(),))
        _gather_single(out, tensor.contiguous().view(-1), group)
        return out.view(-1, *tensor.shape)  # [world, ...] in group-rank order

    @staticmethod
    def backward(ctx, grad):
        mine = grad.new_empty((grad[0].numel(),))
        _reduce_scatter_single(mine, grad.contiguous().view(-1), ctx.group)
        return mine.view(ctx.shape), None


def _gather_single(out: torch.Tensor, tensor: torch.Tensor, group: Any) -> None:
    """torch 2.13's ``all_gather_single``; ``all_gather_into_tensor`` (its older name) where a torch lacks it."""
    gather = getattr(dist, "all_gather_single", None) or dist.all_gather_into_tensor
    gather(out, tensor, group=group)


def _reduce_scatter_single(out: torch.Tensor, tensor: torch.Tensor, group: Any) -> None:
    """torch 2.13's ``reduce_scatter_single`` (a sum); ``reduce_scatter_tensor`` where a torch lacks it."""
    scatter = getattr(dist, "reduce_scatter_single", None) or dist.reduce_scatter_tensor
    scatter(out, tensor, group=group)


def all_gather_autograd(tensor: torch.Tensor, group: Any) -> list[torch.Tensor]:
    """Every rank's ``tensor`` (same shape on every rank of ``group``) in group-rank order, on its own device
    (activations already live on the communication device); the backward sums the gradients back to the
    owner (:class:`_AllGather`). A group of one returns ``[tensor]``."""
    if _world(group) == 1:
        return [tensor]
    return list(_AllGather.apply(tensor, group).unbind(0))  # views of the one buffer


class _AllReduceSum(torch.autograd.Function):
    """Sum over ``group`` in the forward; the backward sums the upstream gradients over the group too (every
    member used the total, so each owes its input the sum of what all of them send back)."""

    @staticmethod
    def forward(ctx, tensor: torch.Tensor, group: Any) -> torch.Tensor:
        ctx.group = group
        out = tensor.clone()
        dist.all_reduce(out, group=group)
        return out

    @staticmethod
    def backward(ctx, grad: torch.Tensor):
        grad = grad.contiguous().clone()
        dist.all_reduce(grad, group=ctx.group)
        return grad, None


def all_reduce_autograd(tensor: torch.Tensor, group: Any) -> torch.Tensor:
    """The sum of ``tensor`` over ``group`` (on its own device), differentiable (:class:`_AllReduceSum`); a group
    of one returns ``tensor``."""
    if _world(group) == 1:
        return tensor
    return _AllReduceSum.apply(tensor, group)
