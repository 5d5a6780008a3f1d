"""Micro-batches onto the GPU one ahead: pinned host memory, asynchronous copies on a side stream.

The sampler builds each micro-batch on the host (numpy rows -> torch tensors). Copied to the GPU
the plain way (``.to(device)``) each copy is synchronous and waits for the host work in front of
it. :class:`DeviceBatches` instead pins the next micro-batch and starts its copy
(``non_blocking=True``) on a side stream while the current one computes; the compute stream waits
for that copy only when it takes the micro-batch. On the CPU it passes the micro-batches through
untouched, so CPU runs are unchanged. Used by the sequential loop and as the pipeline engine's data
iterator (whose ``.to(device)`` of a tensor already there is a no-op).
"""
from __future__ import annotations

from typing import Any, Iterable, Iterator

_END = object()


def _map(item: Any, fn) -> Any:
    """``fn`` applied to every tensor of a nested tuple/list micro-batch (``(ids, (labels, weight))``)."""
    if isinstance(item, (tuple, list)):
        return type(item)(_map(x, fn) for x in item)
    return fn(item) if hasattr(item, "pin_memory") else item


class DeviceBatches:
    """Iterate ``batches`` with every tensor on ``device``, the next one already on its way there."""

    def __init__(self, batches: Iterable[Any], device: Any):
        import torch

        self._it = iter(batches)
        self.device = torch.device(device)
        self._stream = torch.cuda.Stream(self.device) if self.device.type == "cuda" else None
        self._next = self._load() if self._stream is not None else _END

    def _load(self) -> Any:
        import torch

        item = next(self._it, _END)
        if item is _END:
            return item
        with torch.cuda.stream(self._stream):
            return _map(item, lambda t: t.pin_memory().to(self.device, non_blocking=True))

    def __iter__(self) -> Iterator[Any]:
        return self

    def __next__(self) -> Any:
        if self._stream is None:
            return next(self._it)  # CPU: as the sampler made it
        import torch

        item = self._next
        if item is _END:
            raise StopIteration
        current = torch.cuda.current_stream(self.device)
        current.wait_stream(self._stream)  # the copy has landed before compute reads it
        _map(item, lambda t: t.record_stream(current))  # its memory is not reused under the compute stream
        self._next = self._load()  # the next copy overlaps this micro-batch's compute
        return item
