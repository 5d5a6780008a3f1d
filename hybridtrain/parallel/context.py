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
