"""The one owner of the parallel axes: degrees, rank <-> coordinates, the device rules, the DeepSpeed
topology and the process-group handles of a rank.

The rank layout is DeepSpeed's ``PipeModelDataParallelTopology`` (axes ``pipe``, ``data``, ``model``,
the last varying fastest)::

    rank = pp_rank * (dp * tp) + dp_rank * tp + tp_rank

so tensor-parallel peers are adjacent ranks and the pipeline axis is outermost (what crosses nodes
first). Everything that needs a rank's coordinates, the product of the degrees or the groups takes
them from here; adding an axis means a field here and a config key.

Imports neither torch nor deepspeed at module level.
"""
from __future__ import annotations

from dataclasses import dataclass
from typing import Any, Optional

from hybridtrain.errors import PlanError

AXES = ("pp", "dp", "tp")
"""The axes from outermost to innermost (``tp`` fastest), as DeepSpeed orders ``pipe, data, model``."""


@dataclass(frozen=True)
class Coords:
    """One rank's position on every axis."""

    pp: int
    dp: int
    tp: int


@dataclass(frozen=True)
class ParallelDims:
    """The degrees of a run (``world = dp x tp x pp``)."""

    dp: int
    tp: int
    pp: int

    @classmethod
    def of(cls, plan: Any) -> "ParallelDims":
        """The degrees of a :class:`~hybridtrain.plan.types.Plan` (or anything with ``dp``, ``tp``, ``pp``)."""
        return cls(dp=plan.dp, tp=plan.tp, pp=plan.pp)

    @property
    def world(self) -> int:
        return self.dp * self.tp * self.pp

    @property
    def model_ranks(self) -> int:
        """Ranks holding one replica of the model (``tp x pp``)."""
        return self.tp * self.pp

    def coords(self, rank: int) -> Coords:
        """The coordinates of global rank ``rank``."""
        return Coords(pp=rank // (self.dp * self.tp), dp=(rank // self.tp) % self.dp, tp=rank % self.tp)

    def rank(self, c: Coords) -> int:
        """The global rank at coordinates ``c`` (inverse of :meth:`coords`)."""
        return (c.pp * self.dp + c.dp) * self.tp + c.tp

    def all_coords(self) -> list[Coords]:
        """Every rank's coordinates, indexed by global rank."""
        return [self.coords(r) for r in range(self.world)]

    def group_of(self, axis: str, rank: int) -> list[int]:
        """The global ranks of ``rank``'s group along ``axis`` (``tp``, ``dp`` or ``pp``): the ranks that
        differ from it on that axis only."""
        if axis not in AXES:
            raise ValueError(f"unknown axis {axis!r}; use one of {AXES}")
        here = self.coords(rank)
        size = getattr(self, axis)
        return [self.rank(Coords(**{**here.__dict__, axis: i})) for i in range(size)]

    def crossing(self, nodes: int) -> list[str]:
        """The axes (``tp``, ``dp``, ``pp``, in that order) whose groups span more than one of ``nodes``
        nodes under block placement: each node holds ``world / nodes`` consecutive ranks (srun
        ``--distribution=block``, the deepspeed runner).

        The ranks of one group of an axis lie in a block of ``span`` consecutive ranks (``tp``: ``tp``;
        ``dp``: ``dp x tp``; ``pp``: the world) that starts at a multiple of ``span``, and every group of
        a block that a node boundary cuts has members on both sides. So an axis of size > 1 crosses
        exactly when ``span`` does not divide the ranks per node (checked against enumerating every
        group in ``tests/unit/test_units_dims.py``)."""
        if nodes <= 1:
            return []
        per_node = self.world // nodes
        spans = {"tp": self.tp, "dp": self.dp * self.tp, "pp": self.world}
        return [axis for axis, span in spans.items() if getattr(self, axis) > 1 and per_node % span]

    def topology(self):
        """DeepSpeed's ``PipeModelDataParallelTopology`` of these degrees (imports deepspeed)."""
        from deepspeed.runtime.pipe.topology import PipeModelDataParallelTopology

        return PipeModelDataParallelTopology(num_pp=self.pp, num_mp=self.tp, num_dp=self.dp)


def data_parallel_degree(dp: Optional[int], tp: int, pp: int, per_node: Optional[int], nodes: int) -> int:
    """``dp`` of a run whose ``tp x pp`` model ranks are placed on ``nodes`` nodes of ``per_node`` devices
    (``None``: CPU processes, no device limit); ``dp=None`` fills the devices. Raises :class:`PlanError`
    naming the key and the fix when the product does not fit."""
    model_ranks = tp * pp
    if per_node is None:  # CPU processes: no device limit; dp defaults to one replica per node
        dp = dp or nodes
        if nodes > 1 and dp * model_ranks % nodes:
            raise PlanError("parallel.dp", f"dp x tp x pp = {dp * model_ranks} ranks do not spread evenly over "
                            f"launcher.nodes={nodes}")
        return dp
    total = per_node * nodes
    if model_ranks > total:
        raise PlanError("parallel.tp", f"tp x pp = {tp} x {pp} = {model_ranks} ranks exceed the {total} devices "
                        f"(launcher.nodes={nodes} x launcher.gpus_per_node={per_node}); lower tp or pp, or add devices")
    chosen = dp if dp is not None else total // model_ranks
    world = chosen * model_ranks
    if (world != total) if dp is None else (world > total):
        raise PlanError("parallel.dp", f"dp x tp x pp = {chosen} x {tp} x {pp} = {world} does not fit the {total} "
                        f"devices (launcher.nodes={nodes} x launcher.gpus_per_node={per_node}); use dp <= "
                        f"{total // model_ranks}" + ("" if dp is not None else f" and tp x pp dividing {total}"))
    return chosen


@dataclass
class ParallelGroups:
    """One rank's process groups, taken from DeepSpeed's ``PipelineParallelGrid`` once it exists.

    Passed explicitly to whoever runs a collective (no module globals). ``tp`` is the
    :class:`~hybridtrain.parallel.context.TPContext` the layers hold.
    """

    dims: ParallelDims
    coords: Coords
    tp: Any
    """This rank's :class:`~hybridtrain.parallel.context.TPContext`."""
    dp_group: Any = None
    """``torch.distributed`` group of the data-parallel replicas of this rank's (pipe, model) position."""
    model_group: Any = None
    """The pipe x tensor ranks of this rank's replica (the gradient-norm group)."""

    @classmethod
    def from_grid(cls, dims: ParallelDims, grid: Any, tp: Any) -> "ParallelGroups":
        """Bind ``tp`` to the grid's TP ("slice") group and take the other groups from ``grid``."""
        tp.bind_grid(grid)
        coords = Coords(pp=grid.get_stage_id(), dp=grid.get_data_parallel_rank(), tp=tp.rank)
        return cls(dims=dims, coords=coords, tp=tp, dp_group=grid.get_data_parallel_group(),
                   model_group=grid.get_model_parallel_group())
