"""The process-group handles (tensor, expert, context parallel) that layers receive explicitly (no module globals)."""
from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

import torch


@dataclass
class TPContext:
    """This rank's tensor-parallel group.

    Created unbound before the DeepSpeed pipeline grid exists and bound once the grid has built
    its process groups (see :mod:`hybridtrain.engine.pipeline`); layers only read it when they run.
    """

    group: Any = None
    """``torch.distributed`` group of the ranks sharing this rank's (pipe, data) coordinate."""
    rank: int = 0
    """This rank's index inside :attr:`group` (``tp_rank``)."""
    size: int = 1
    """Number of ranks in :attr:`group` (the ``tp`` degree)."""

    def bind_grid(self, grid: Any) -> None:
        """Take the TP group from a DeepSpeed ``PipelineParallelGrid`` (its "slice" group)."""
        self.group = grid.get_slice_parallel_group()
        self.rank = grid.get_slice_parallel_rank()
        self.size = grid.get_slice_parallel_world_size()

    def shard(self, n: int) -> tuple[int, int]:
        """``[start, stop)`` of this rank's equal slice of ``n`` items (``n % size == 0``)."""
        assert n % self.size == 0, f"{n} does not split over tp={self.size}"
        step = n // self.size
        return self.rank * step, (self.rank + 1) * step


@dataclass
class EPContext:
    """This rank's expert-parallel group (``parallel.ep``): the ranks that hold the other slices of every MoE
    layer's experts and exchange tokens with it (:mod:`hybridtrain.parallel.experts`).

    ``rank`` and ``size`` follow from the plan (:meth:`~hybridtrain.parallel.dims.ParallelDims.expert_rank`), so
    the experts are sliced before any process group exists; :attr:`group` is bound when the groups are made
    (:mod:`hybridtrain.parallel.groups`) and read only in the forward."""

    group: Any = None
    """``torch.distributed`` group of this rank's expert-parallel peers (``None`` until bound, or at ep = 1)."""
    rank: int = 0
    """This rank's index in the group: it holds experts ``[rank x E / size, (rank + 1) x E / size)``."""
    size: int = 1
    """The ``ep`` degree."""

    def shard(self, n: int) -> tuple[int, int]:
        """``[start, stop)`` of this rank's equal slice of ``n`` experts (``n % size == 0``)."""
        assert n % self.size == 0, f"{n} experts do not split over ep={self.size}"
        step = n // self.size
        return self.rank * step, (self.rank + 1) * step


@dataclass
class CPContext:
    """This rank's context-parallel group (``parallel.cp``): the ranks that split every row's sequence in
    ``2 x size`` equal chunks, head-tail (rank ``r`` holds chunks ``r`` and ``2 x size - 1 - r``, so causal work
    is balanced), and all-gather keys and values in attention (:mod:`hybridtrain.parallel.context_parallel`).

    ``rank`` and ``size`` follow from the plan; :attr:`group` is bound when the groups are made
    (:mod:`hybridtrain.parallel.groups`) and read only in the forward."""

    group: Any = None
    """``torch.distributed`` group of this rank's context-parallel peers (``None`` until bound, or at cp = 1)."""
    rank: int = 0
    """This rank's index in :attr:`group` (``cp_rank``): which two chunks of each row it holds."""
    size: int = 1
    """The ``cp`` degree."""

    _made: dict = field(default_factory=dict, init=False, repr=False, compare=False)
    """The index tensors :meth:`indices` made, by (``seq_len``, device)."""

    def indices(self, seq_len: int, device: torch.device | str | None = None) -> torch.Tensor:
        """The global token indices (int64 ``[seq_len / size]``) of this rank's two chunks of a row of ``seq_len``
        tokens (:func:`chunk_indices`), on ``device`` (the host when ``None``). Made once per length and device and
        kept: every stage, block and loss of every micro-batch asks for them, and on a GPU each new copy would be
        a blocking host-to-device copy (gpu-review-3 finding 6). Read them, never write into them."""
        key = (seq_len, None if device is None else torch.device(device))
        made = self._made.get(key)
        if made is None:
            made = chunk_indices(seq_len, self.size, self.rank)
            if device is not None:
                made = made.to(device)
            self._made[key] = made
        return made

    def ranges(self, seq_len: int) -> list[tuple[int, int]]:
        """The same tokens as :meth:`indices`, as contiguous ``[start, stop)`` runs in the order the rank holds them:
        ``[(0, seq_len)]`` at ``size = 1``, else chunk ``rank`` and chunk ``2 x size - 1 - rank``."""
        if self.size == 1:
            return [(0, seq_len)]
        chunk_indices(seq_len, self.size, self.rank)  # the same checks and messages
        c = seq_len // (2 * self.size)
        tail = 2 * self.size - 1 - self.rank
        return [(self.rank * c, (self.rank + 1) * c), (tail * c, (tail + 1) * c)]


def chunk_indices(seq_len: int, cp: int, rank: int) -> torch.Tensor:
    """The global token indices (int64 ``[seq_len / cp]``) that cp rank ``rank`` holds of a row of ``seq_len``
    tokens: chunk ``rank`` then chunk ``2 x cp - 1 - rank`` of ``2 x cp`` equal chunks. ``cp = 1``: ``arange``.
    Raises ``ValueError`` when ``2 x cp`` does not divide ``seq_len``.

    Re-exported by :mod:`hybridtrain.parallel.context_parallel`; it lives with the handle, as
    :meth:`TPContext.shard` does, so the attention module imports the handle and not the other way round."""
    if cp < 1 or not 0 <= rank < cp:
        raise ValueError(f"cp rank {rank} of cp={cp}: need cp >= 1 and 0 <= rank < cp")
    if cp == 1:
        return torch.arange(seq_len)
    if seq_len % (2 * cp):
        raise ValueError(f"sequence length {seq_len} does not split into 2 x cp = {2 * cp} equal chunks; "
                         f"use a data.seq_len that is a multiple of {2 * cp}")
    c = seq_len // (2 * cp)  # tokens per chunk
    return torch.cat([torch.arange(rank * c, (rank + 1) * c), torch.arange((2 * cp - 1 - rank) * c, (2 * cp - rank) * c)])
