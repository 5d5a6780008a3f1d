"""The tensor-parallel group handle that layers receive explicitly (no module globals)."""
from __future__ import annotations

from dataclasses import dataclass
from typing import Any


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
