"""Context parallelism for a recurrent token mixer (Gated DeltaNet): the state passed between the cp ranks in
sequence order.

A cp rank holds two chunks of every row, chunk ``r`` and chunk ``2 x cp - 1 - r`` of ``2 x cp``
(:class:`~hybridtrain.parallel.context.CPContext`). A recurrence over the row needs, at the start of each chunk,
the carry the previous chunk ended with (the recurrent state and the conv window). In sequence order the chunks'
owners are ``0, 1, ..., cp - 1, cp - 1, ..., 1, 0``, so the carry walks the cp group up through the ranks' first
chunks and back down through their second chunks::

    rank r:  recv(r - 1) -> first chunk -> send(r + 1)     recv(r + 1) -> second chunk -> send(r - 1)
             (rank cp - 1 hands its first chunk's carry to its own second chunk)

The backward walks the same path in reverse with the carries' gradients. So the mixer's work is sequential over
the ``2 x cp`` chunks of a row: at cp > 1 these layers save memory (each rank keeps its own chunks' activations)
but no time; the pass itself moves one carry per row per hop (``docs/long-context.md``).

Everything runs inside one autograd function per block (:func:`pass_state`), so that its point-to-point messages
never interleave with another collective on the same ranks: the forward computes without a graph; the backward
recomputes each chunk from its input and carry (with detached copies of the module's parameters) and hands the
parameters' gradients back only when its last message has gone. Gradient hooks (the tensor-parallel ``grad_sum``,
DeepSpeed's reduction) then run once per parameter, after the pass, as for any other layer. Under activation
checkpointing the block's recomputation replays the carries its first forward received (:class:`CarryLog`)
instead of passing them again (the peers are then in their backward).
"""
from __future__ import annotations

from typing import Callable

import torch

from hybridtrain.parallel import collectives
from hybridtrain.parallel.context import CPContext

__all__ = ["CarryLog", "ChunkRun", "pass_state"]

ChunkRun = Callable[[int, torch.Tensor, torch.Tensor], tuple[torch.Tensor, torch.Tensor]]
"""``run(i, x [B, c, H], carry_in [B, D]) -> (y [B, c, H], carry_out [B, D])``: the mixer over the rank's chunk
``i`` (0: its first chunk, 1: its second) from the carry the previous chunk (in sequence order) left; the module's
own parameters, so that :func:`pass_state` can run it over copies of them."""


class CarryLog:
    """The carries one block's forward received, for its recomputation under activation checkpointing: the first
    :func:`pass_state` call with a log receives and records them, every later call with it replays them and sends
    nothing (the block's recomputation in the backward computes what its first forward did)."""

    def __init__(self) -> None:
        self.received: list[torch.Tensor] | None = None


def carry_dtype(dtype: torch.dtype) -> torch.dtype:
    """The dtype the carry travels in for activations of ``dtype``: float32 (the delta rule's state is float32 for
    16-bit activations too), float64 for float64 ones."""
    return torch.promote_types(dtype, torch.float32)


def _send(tensor: torch.Tensor, cp: CPContext, rank: int) -> None:
    collectives.send(tensor, cp.group, rank)


def _recv(like: torch.Tensor, cp: CPContext, rank: int) -> torch.Tensor:
    return collectives.recv(like, cp.group, rank)


class _StatePass(torch.autograd.Function):
    """``hidden [B, 2c, H]`` (the rank's two chunks) -> the mixer's output ``[B, 2c, H]``, the carry passed along
    the cp ranks in sequence order (the module docstring); the gradients of ``hidden`` and of ``params``."""

    @staticmethod
    def forward(ctx, hidden, module, names, run, cp, width, log, *params):
        r, n = cp.rank, cp.size
        first, second = hidden.chunk(2, dim=1)  # [B, c, H]: chunk r, chunk 2n - 1 - r
        dtype = carry_dtype(hidden.dtype)
        zero = torch.zeros(hidden.shape[0], width, dtype=dtype, device=hidden.device)  # [B, D]
        replay = log is not None and log.received is not None
        replayed = iter(log.received) if replay else None
        received: list[torch.Tensor] = []

        def receive(peer: int) -> torch.Tensor:
            if replay:
                return next(replayed)
            got = _recv(zero, cp, peer)
            received.append(got)
            return got

        def send(carry: torch.Tensor, peer: int) -> None:
            if not replay:
                _send(carry.to(dtype), cp, peer)

        carry_first = receive(r - 1) if r > 0 else zero
        y_first, out_first = run(0, first, carry_first)
        if r < n - 1:
            send(out_first, r + 1)
            carry_second = receive(r + 1)
        else:  # the last rank's first chunk is followed by its own second chunk
            carry_second = out_first.to(dtype)
        y_second, out_second = run(1, second, carry_second)
        if r > 0:
            send(out_second, r - 1)
        if log is not None and not replay:
            log.received = received
        ctx.save_for_backward(hidden, *params)
        ctx.carries = (carry_first, carry_second)  # small ([B, D]); kept as they came, not recomputed
        ctx.module, ctx.names, ctx.run, ctx.cp = module, names, run, cp
        return torch.cat([y_first, y_second], dim=1)

    @staticmethod
    def backward(ctx, grad):
        hidden, *params = ctx.saved_tensors
        cp, r, n = ctx.cp, ctx.cp.rank, ctx.cp.size
        first, second = hidden.chunk(2, dim=1)
        g_first, g_second = grad.chunk(2, dim=1)
        carry_first, carry_second = ctx.carries
        zero = torch.zeros_like(carry_first)
        # The reverse path: the second chunk's carry gradient comes from the rank after it in sequence order.
        g_out_second = _recv(zero, cp, r - 1) if r > 0 else zero
        gx_second, gc_second, gp_second = _chunk_grads(ctx, params, 1, second, carry_second, g_second, g_out_second)
        if r < n - 1:
            _send(gc_second, cp, r + 1)
            g_out_first = _recv(zero, cp, r + 1)
        else:
            g_out_first = gc_second
        gx_first, gc_first, gp_first = _chunk_grads(ctx, params, 0, first, carry_first, g_first, g_out_first)
        if r > 0:
            _send(gc_first, cp, r - 1)
        grads = [a + b if a is not None else None for a, b in zip(gp_first, gp_second)]
        return (torch.cat([gx_first, gx_second], dim=1), None, None, None, None, None, None, *grads)


def _chunk_grads(ctx, params: list[torch.Tensor], index: int, x: torch.Tensor, carry: torch.Tensor,
                 grad_y: torch.Tensor, grad_carry: torch.Tensor):
    """Recompute chunk ``index`` with a graph and return the gradients of its input, its incoming carry and the
    module's parameters (``None`` for a frozen one), given those of its output and outgoing carry."""
    from torch.nn.utils.stateless import _reparametrize_module  # what torch.func.functional_call swaps with

    x = x.detach().requires_grad_(True)
    carry = carry.detach().requires_grad_(True)
    copies = {name: p.detach().requires_grad_(p.requires_grad) for name, p in zip(ctx.names, params)}
    trained = [copies[name] for name in ctx.names if copies[name].requires_grad]
    with torch.enable_grad(), _reparametrize_module(ctx.module, copies):
        y, carry_out = ctx.run(index, x, carry)
        got = torch.autograd.grad((y, carry_out.to(carry.dtype)), [x, carry, *trained], (grad_y, grad_carry),
                                  allow_unused=True)
    got = [torch.zeros_like(t) if g is None else g for g, t in zip(got, [x, carry, *trained])]
    it = iter(got[2:])
    return got[0], got[1], [next(it) if copies[name].requires_grad else None for name in ctx.names]


def pass_state(module: torch.nn.Module, run: ChunkRun, hidden: torch.Tensor, cp: CPContext, width: int,
               log: CarryLog | None = None) -> torch.Tensor:
    """The recurrent mixer ``module`` over this cp rank's two chunks ``hidden [B, 2c, H]`` (first chunk, second
    chunk, as :meth:`~hybridtrain.parallel.context.CPContext.indices` orders them), each started from the carry
    (``[B, width]`` per row) the chunk before it in sequence order ended with: ``[B, 2c, H]``,
    differentiable in ``hidden`` and in ``module``'s parameters (the module docstring). ``run`` computes one
    chunk (:data:`ChunkRun`) with carries of :func:`carry_dtype`; ``log``: the block's :class:`CarryLog` under activation checkpointing."""
    named = list(module.named_parameters())
    names = tuple(name for name, _ in named)
    return _StatePass.apply(hidden, module, names, run, cp, width, log, *(p for _, p in named))
