"""Counting the calls that would stop a CUDA stream for the host, on a CPU (gpu-review-3 finding 2).

On a CPU nothing waits, so the count is of the calls themselves, seen through a ``TorchFunctionMode``: a
read of a tensor's values into Python (``item``, ``tolist``, ``int()``, ``bool()`` ...), a copy to the host
(``cpu``, ``numpy``, ``to("cpu")``), and the ops whose CUDA kernels read a size or a range to the host before
they can allocate their output (``bincount``: min and max; ``nonzero``, ``unique``, ``masked_select``, a
boolean-mask index, ``repeat_interleave`` without ``output_size``). Ops run in C++ by autograd's engine are
not seen; a Python ``autograd.Function``'s backward is. The recompute of ``torch.utils.checkpoint`` runs
where an outer mode is not active: :func:`counted_calls` counts inside the checkpointed function instead.
"""
from __future__ import annotations

from typing import Callable

import torch
from torch.overrides import TorchFunctionMode

READS = {"item", "tolist", "__int__", "__float__", "__bool__", "__index__", "cpu", "numpy"}
SIZED_BY_THE_HOST = {"bincount", "nonzero", "unique", "unique_consecutive", "masked_select", "argwhere"}


def _is_host(device) -> bool:
    return device is not None and torch.device(device).type == "cpu"


class HostSyncs(TorchFunctionMode):
    """``with HostSyncs() as syncs: ...``; then ``syncs.calls`` lists the names of the syncing calls made."""

    def __init__(self) -> None:
        super().__init__()
        self.calls: list[str] = []

    def __torch_function__(self, func, types, args=(), kwargs=None):
        kwargs = kwargs or {}
        name = getattr(func, "__name__", "")
        if name in READS or name in SIZED_BY_THE_HOST:
            self.calls.append(name)
        elif name == "to" and (_is_host(kwargs.get("device")) or any(
                isinstance(a, (str, torch.device)) and _is_host(a) for a in args[1:])):
            self.calls.append("to(cpu)")
        elif name == "__getitem__" and isinstance(args[1], torch.Tensor) and args[1].dtype == torch.bool:
            self.calls.append("boolean index")
        elif name == "repeat_interleave" and isinstance(args[1] if len(args) > 1 else kwargs.get("repeats"),
                                                        torch.Tensor) and kwargs.get("output_size") is None:
            self.calls.append("repeat_interleave")
        return func(*args, **kwargs)


def counted_calls(fn: Callable, runs: list) -> Callable:
    """``fn`` that appends the syncing calls of each of its runs to ``runs`` (a checkpointed function's forward,
    then its recompute)."""
    def run(*args, **kwargs):
        syncs = HostSyncs()
        try:
            with syncs:
                return fn(*args, **kwargs)
        finally:  # torch stops a recompute early, by an exception, once it has remade what the backward needs
            runs.append(syncs.calls)
    return run
