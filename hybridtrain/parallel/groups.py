"""Every process group hybridtrain uses, derived from the run's :class:`~hybridtrain.parallel.dims.ParallelDims`,
behind DeepSpeed's ``mpu`` protocol.

DeepSpeed's pipeline engine builds its groups itself (``PipelineModule`` makes a ``PipelineParallelGrid`` from
the topology it is given, :meth:`ParallelDims.topology`), so the groups of DeepSpeed's three axes
(``pipe``, ``data = dp x cp``, ``model``) and the pipe x model group are taken from that grid, made once; at
pp = 1 this module makes the same grid of one stage. An axis DeepSpeed's grid does not know (``cp``) gets its
groups here with ``new_group``, over :meth:`ParallelDims.groups`, only when its degree is > 1. So do the
expert-parallel and expert-data-parallel groups of ``parallel.ep`` > 1 (:meth:`ParallelDims.expert_groups`),
which are also filed in DeepSpeed's expert-group registry (``deepspeed.utils.groups``, the one process-wide
state involved: DeepSpeed's engine, ZeRO and gradient norm look the groups up there by name).

:class:`ParallelGroups` is what the loop, the evaluator, the gradient clipper and ZeRO-3's partitioner
take; at pp = 1 it is the ``mpu`` DeepSpeed gets. Nothing outside :mod:`hybridtrain.parallel` touches
DeepSpeed's grid, topology or ``new_group``.
"""
from __future__ import annotations

from datetime import timedelta
from typing import Any

from hybridtrain.parallel.context import CPContext, EPContext, TPContext
from hybridtrain.parallel.dims import AXES, Coords, ParallelDims

GRID_AXES = ("pp", "dp", "tp")
"""The axes whose groups DeepSpeed's ``PipelineParallelGrid`` makes (``pipe``, ``data`` with ``cp`` folded in,
``model``); every other axis of :data:`~hybridtrain.parallel.dims.AXES` gets its groups here."""


class ParallelGroups:
    """One rank's coordinates and process groups, passed explicitly to whoever runs a collective (no module
    globals), presenting DeepSpeed's ``mpu`` protocol (the methods DeepSpeed's engine, ZeRO and
    ``deepspeed.utils.groups`` call on an ``mpu``).

    DeepSpeed's sequence-parallel accessors (``get_sequence_parallel_*``) are left out on purpose: given them,
    DeepSpeed (its Ulysses convention) sums the gradients over the sequence-parallel ranks instead of averaging
    (``engine.py`` and ZeRO divide by ``data / sp``), for losses that are each rank's share of the mean.
    hybridtrain's context-parallel ranks weight their losses as data-parallel replicas do
    (:attr:`~hybridtrain.parallel.dims.BatchLayout.averaged_over`), which the pipeline engine, whose grid knows
    no sequence axis, averages over ``dp x cp``; so DeepSpeed sees one data axis, ``dp x cp``, in both engines.
    The cp group is :attr:`cp`'s.

    Built by :func:`sequential_groups` (pp = 1) or :func:`pipeline_groups` (pp > 1).
    """

    def __init__(self, dims: ParallelDims, grid: Any, tp: TPContext, rank: int, ep: EPContext | None = None,
                 cp: CPContext | None = None):
        self.dims = dims
        """The run's degrees."""
        self.coords: Coords = dims.coords(rank)
        """This rank's coordinates."""
        self.tp = tp
        """This rank's :class:`~hybridtrain.parallel.context.TPContext` (bound to the grid's TP group)."""
        self._grid = grid
        self.axis_groups: dict[str, Any] = {axis: _axis_group(dims, axis, rank) for axis in AXES
                                            if axis not in GRID_AXES}
        """This rank's group of each axis DeepSpeed's grid does not know (``None`` at degree 1)."""
        self.cp = cp or CPContext(rank=self.coords.cp, size=dims.cp)
        """This rank's :class:`~hybridtrain.parallel.context.CPContext`, bound to its context-parallel group."""
        self.cp.group = self.axis_groups["cp"]
        self.ep = ep or EPContext(rank=dims.expert_rank(rank), size=dims.ep)
        """This rank's :class:`~hybridtrain.parallel.context.EPContext` (bound to its expert-parallel group)."""
        self.expert_data_group: Any = None
        """The ranks holding the same experts as this one (``dp / ep`` of them; ``None`` at ep = 1)."""
        if dims.ep > 1:
            self.ep.group, self.expert_data_group = _expert_groups(dims, rank)

    # -- the groups hybridtrain reads ------------------------------------------------------------------

    @property
    def data_group(self) -> Any:
        """The ranks holding the same weights as this one (``dp x cp``): loss averages, ZeRO, gradient reduction."""
        return self._grid.get_data_parallel_group()

    @property
    def model_group(self) -> Any:
        """The pipe x tensor ranks of this rank's replica (the gradient-norm group)."""
        return self._grid.get_model_parallel_group()

    # -- DeepSpeed's mpu protocol --------------------------------------------------------------------

    def get_data_parallel_group(self) -> Any:
        return self.data_group

    def get_data_parallel_rank(self) -> int:
        return self._grid.get_data_parallel_rank()

    def get_data_parallel_world_size(self) -> int:
        return self.dims.data

    def get_data_parallel_group_ranks(self) -> list[int]:
        return self._grid.get_data_parallel_group_ranks()

    def get_model_parallel_group(self) -> Any:
        return self.model_group

    def get_model_parallel_rank(self) -> int:
        return self._grid.get_model_parallel_rank()

    def get_model_parallel_world_size(self) -> int:
        return self.dims.model_ranks

    def get_slice_parallel_group(self) -> Any:
        return self._grid.get_slice_parallel_group()

    def get_slice_parallel_rank(self) -> int:
        return self.coords.tp

    def get_slice_parallel_world_size(self) -> int:
        return self.dims.tp

    get_tensor_model_parallel_group = get_slice_parallel_group
    get_tensor_model_parallel_rank = get_slice_parallel_rank
    get_tensor_model_parallel_world_size = get_slice_parallel_world_size

    def get_pipe_parallel_group(self) -> Any:
        return self._grid.get_pipe_parallel_group()

    def get_pipe_parallel_rank(self) -> int:
        return self.coords.pp

    def get_pipe_parallel_world_size(self) -> int:
        return self.dims.pp

    get_pipeline_model_parallel_group = get_pipe_parallel_group
    get_pipeline_model_parallel_rank = get_pipe_parallel_rank
    get_pipeline_model_parallel_world_size = get_pipe_parallel_world_size


def time_out_groups_like_world(timeout: timedelta) -> None:
    """Every process group made after this call, here or inside DeepSpeed, times out after ``timeout`` (the
    world group's, ``launcher.timeout_minutes``).

    torch gives a ``new_group`` made without a timeout of its own the backend's default (30 minutes on gloo,
    10 on NCCL), not the world group's, and DeepSpeed's grid, its expert groups and its ZeRO partitioner call
    ``new_group(ranks)`` without one: a checkpoint gather over the TP group during a long save would time out
    at 10 minutes whatever the run asked. torch has no public setter for that default; this sets the two module
    defaults ``distributed_c10d._get_default_timeout`` reads (torch 2.13). Call it once per rank, after the world
    group exists and before the engine is built."""
    import torch.distributed.distributed_c10d as c10d

    c10d.default_pg_timeout = timeout
    c10d.default_pg_nccl_timeout = timeout


def _axis_group(dims: ParallelDims, axis: str, rank: int) -> Any:
    """``rank``'s group along an axis DeepSpeed's grid does not build, made with ``new_group`` by every rank
    for every group of the axis in the same order (a collective); ``None`` when the axis has degree 1."""
    if getattr(dims, axis) == 1:
        return None
    import torch.distributed as dist

    mine = None
    for ranks in dims.groups(axis):
        group = dist.new_group(ranks)
        if rank in ranks:
            mine = group
    return mine


def _expert_groups(dims: ParallelDims, rank: int) -> tuple[Any, Any]:
    """``rank``'s expert-parallel and expert-data-parallel groups (every group made by every rank, in order),
    filed in DeepSpeed's registry under :func:`~hybridtrain.parallel.experts.expert_group_name` as its own
    ``_create_expert_data_and_model_parallel`` would (the same ranks: ``tests/unit/test_units_dims.py``)."""
    import torch.distributed as dist
    from deepspeed.utils import groups as ds_groups

    from hybridtrain.parallel.experts import expert_group_name

    mine: dict[str, tuple[Any, list[int]]] = {}
    for kind, all_groups in zip(("ep", "edp"), dims.expert_groups()):
        for ranks in all_groups:
            group = dist.new_group(ranks)
            if rank in ranks:
                mine[kind] = (group, list(ranks))
    name = expert_group_name(dims.ep)
    ds_groups._EXPERT_PARALLEL_GROUP[name], ds_groups._EXPERT_PARALLEL_GROUP_RANKS[name] = mine["ep"]
    ds_groups._EXPERT_DATA_PARALLEL_GROUP[name], ds_groups._EXPERT_DATA_PARALLEL_GROUP_RANKS[name] = mine["edp"]
    ds_groups.expert_tensor_parallel_world_size = dims.tp  # experts are split over tp too (its gradient norm)
    return mine["ep"][0], mine["edp"][0]


def sequential_groups(dims: ParallelDims, tp: TPContext, ep: EPContext | None = None,
                      cp: CPContext | None = None) -> ParallelGroups:
    """The groups of a pp = 1 run: DeepSpeed's ``PipelineParallelGrid`` of one stage over
    :meth:`ParallelDims.topology` (so both engines use the same rank layout); binds ``tp`` to its TP group
    before any layer is built (the layers read it)."""
    import torch.distributed as dist
    from deepspeed.runtime.pipe.topology import PipelineParallelGrid

    grid = PipelineParallelGrid(topology=dims.topology())
    tp.bind_grid(grid)
    return ParallelGroups(dims, grid, tp, dist.get_rank(), ep, cp)


def bind_pipeline_tp(module: Any, tp: TPContext) -> None:
    """Bind ``tp`` to the TP group of a DeepSpeed ``PipelineModule``'s grid (which it makes in its constructor,
    before it builds its layers: :mod:`hybridtrain.engine.pipeline` calls this in between)."""
    tp.bind_grid(module.mpu())


def pipeline_groups(dims: ParallelDims, module: Any, tp: TPContext, ep: EPContext | None = None,
                    cp: CPContext | None = None) -> ParallelGroups:
    """The groups of a pp > 1 run, from the grid its ``PipelineModule`` made (``tp`` already bound to it);
    ``ep`` and ``cp`` (the layers' expert- and context-parallel contexts) are bound to the groups made here."""
    import torch.distributed as dist

    return ParallelGroups(dims, module.mpu(), tp, dist.get_rank(), ep, cp)
