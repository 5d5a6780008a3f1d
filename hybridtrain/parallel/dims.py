"""The one owner of the parallel axes: degrees, rank <-> coordinates, the device rules, the DeepSpeed
topology and the batch layout.

The ranks form one grid over the axes of :data:`AXES`, outermost first, the last varying fastest::

    rank = ((pp_rank * dp + dp_rank) * cp + cp_rank) * tp + tp_rank

so tensor-parallel peers are adjacent ranks and the pipeline axis is outermost (what crosses nodes
first). Coordinates, groups and spans are computed from that one ordered tuple, for every axis alike.
DeepSpeed sees three axes, ``pipe x data x model`` (``PipeModelDataParallelTopology``) with
``data = dp x cp``: ZeRO and the gradient reduction run over every rank that holds the same weights.

Expert parallelism is not an axis of its own: its groups are folded inside the data axis (consecutive
members of a data-parallel group hold different experts), as DeepSpeed, Megatron and torchtitan do;
:meth:`ParallelDims.expert_groups` derives them from the same grid.

Adding an axis: its name in :data:`AXES` at its place in the order, its field here, its ``parallel.*``
config key and its planner terms (``docs/contributing.md``). Imports neither torch nor deepspeed at
module level.
"""
from __future__ import annotations

import math
from dataclasses import dataclass, fields
from typing import Any, Optional

from hybridtrain.errors import PlanError

AXES = ("pp", "dp", "cp", "tp")
"""The rank axes from outermost to innermost (``tp`` fastest)."""

SHOWN = ("dp", "cp", "tp", "pp")
"""The order rank maps print coordinates in (:meth:`ParallelDims.shown_axes`)."""

ALWAYS_SHOWN = ("dp", "tp", "pp")
"""The axes every rank map prints, split or not; another axis is printed only where it splits the ranks."""

DATA_AXES = ("dp", "cp")
"""The axes DeepSpeed's ``data`` axis spans: ranks on them hold the same weights (ZeRO partitions and the
gradient all-reduce cover them)."""


@dataclass(frozen=True, kw_only=True)
class Coords:
    """One rank's position on every axis."""

    pp: int = 0
    dp: int = 0
    cp: int = 0
    tp: int = 0


@dataclass(frozen=True, kw_only=True)
class ParallelDims:
    """The degrees of a run (``world = pp x dp x cp x tp``), keyword-only so no call can swap two axes."""

    pp: int = 1
    """Pipeline stages."""
    dp: int = 1
    """Data-parallel replicas."""
    cp: int = 1
    """Context-parallel ranks splitting each sequence (1: every rank holds whole rows)."""
    tp: int = 1
    """Tensor-parallel ranks splitting each layer."""
    ep: int = 1
    """Expert-parallel ranks, a view folded inside ``dp x cp`` (not a rank axis; 1: every rank holds every
    expert)."""

    def __post_init__(self) -> None:
        for f in fields(self):
            if not isinstance(getattr(self, f.name), int) or getattr(self, f.name) < 1:
                raise ValueError(f"{f.name}={getattr(self, f.name)!r}: a degree is an integer >= 1")
        if self.data % self.ep:
            raise ValueError(f"ep={self.ep} must divide dp x cp = {self.data}")

    def shown_axes(self) -> list[str]:
        """The axes a rank map (start-up, ``python -m hybridtrain.plan``) prints, in :data:`SHOWN` order."""
        return [axis for axis in SHOWN if axis in ALWAYS_SHOWN or getattr(self, axis) > 1]

    def product(self) -> str:
        """The layout as the start-up lines print it: ``dp=2 x tp=2 x pp=2`` (the :meth:`shown_axes`; the expert
        view after them when ``ep`` > 1)."""
        out = " x ".join(f"{axis}={getattr(self, axis)}" for axis in self.shown_axes())
        return out + (f" (experts over ep={self.ep} of the dp ranks)" if self.ep > 1 else "")

    def formula(self) -> str:
        """The world as messages state it: ``dp x tp x pp = 2 x 2 x 2`` (the :meth:`shown_axes`)."""
        axes = self.shown_axes()
        return " x ".join(axes) + " = " + " x ".join(str(getattr(self, a)) for a in axes)

    def degrees(self) -> dict[str, int]:
        """``{axis: degree}`` of every rank axis, in :data:`AXES` order."""
        return {axis: getattr(self, axis) for axis in AXES}

    @property
    def world(self) -> int:
        return math.prod(self.degrees().values())

    @property
    def data(self) -> int:
        """DeepSpeed's data-parallel degree: ``dp x cp`` (ranks holding the same weights)."""
        return math.prod(getattr(self, a) for a in DATA_AXES)

    @property
    def model_ranks(self) -> int:
        """Ranks holding one replica of the model (``pp x tp``)."""
        return self.world // self.data

    def stride(self, axis: str) -> int:
        """Distance in ranks between neighbours on ``axis``: the product of the degrees inside it."""
        inner = AXES[self._index(axis) + 1:]
        return math.prod(getattr(self, a) for a in inner)

    def span(self, axis: str) -> int:
        """Consecutive ranks one group of ``axis`` lies in (``stride x degree``); groups start at its multiples."""
        return self.stride(axis) * getattr(self, axis)

    def coords(self, rank: int) -> Coords:
        """The coordinates of global rank ``rank``."""
        return Coords(**{axis: rank // self.stride(axis) % getattr(self, axis) for axis in AXES})

    def rank(self, c: Coords) -> int:
        """The global rank at coordinates ``c`` (inverse of :meth:`coords`)."""
        return sum(getattr(c, axis) * self.stride(axis) for axis in AXES)

    def all_coords(self) -> list[Coords]:
        """Every rank's coordinates, indexed by global rank."""
        return [self.coords(r) for r in range(self.world)]

    def group_of(self, axis: str, rank: int) -> list[int]:
        """The global ranks of ``rank``'s group along ``axis`` (one of :data:`AXES`): the ranks that
        differ from it on that axis only."""
        here = rank - getattr(self.coords(rank), self._axis(axis)) * self.stride(axis)
        return [here + i * self.stride(axis) for i in range(getattr(self, axis))]

    def groups(self, axis: str) -> list[list[int]]:
        """Every group along ``axis``, ordered by their lowest rank (the order every rank must create
        them in, as ``torch.distributed.new_group`` requires)."""
        seen = {tuple(self.group_of(axis, r)) for r in range(self.world)}
        return [list(g) for g in sorted(seen)]

    def data_group_of(self, rank: int) -> list[int]:
        """``rank``'s group on DeepSpeed's data axis (``dp x cp``): the ranks equal to it on every other axis."""
        c = self.coords(rank)
        out = [rank]
        for axis in DATA_AXES:
            out = [r - getattr(c, axis) * self.stride(axis) + i * self.stride(axis)
                   for r in out for i in range(getattr(self, axis))]
        return sorted(out)

    def expert_groups(self) -> tuple[list[list[int]], list[list[int]]]:
        """``(expert-parallel groups, expert-data-parallel groups)``: each data group (``dp x cp``) cut into
        ``data / ep`` runs of ``ep`` consecutive members (one expert shard each), and the members at the
        same place of every run (the replicas of one expert shard). DeepSpeed's default layout
        (``deepspeed.utils.groups._get_expert_parallel_ranks``; checked in tests/unit/test_units_dims.py)."""
        experts, replicas = [], []
        data_groups = sorted({tuple(self.data_group_of(r)) for r in range(self.world)})
        for group in data_groups:
            runs = [list(group[i:i + self.ep]) for i in range(0, len(group), self.ep)]
            experts += runs
            replicas += [[run[j] for run in runs] for j in range(self.ep)]
        return sorted(experts), sorted(replicas)

    def expert_rank(self, rank: int) -> int:
        """``rank``'s place in its expert-parallel group (:meth:`expert_groups`): which slice of the experts it holds."""
        return self.data_group_of(rank).index(rank) % self.ep

    def crossing(self, nodes: int) -> list[str]:
        """The axes (innermost first: ``tp``, ``cp``, ``dp``, ``pp``, then ``ep`` where :meth:`experts_cross`) whose
        groups span more than one of ``nodes`` nodes under block placement: each node holds ``world / nodes`` consecutive ranks (srun
        ``--distribution=block``, the deepspeed runner).

        The ranks of one group of an axis lie in a block of :meth:`span` consecutive ranks that starts at a
        multiple of the span, and every group of a block that a node boundary cuts has members on both
        sides. So an axis of degree > 1 crosses exactly when its span does not divide the ranks per node
        (checked against enumerating every group in ``tests/unit/test_units_dims.py``)."""
        if nodes <= 1:
            return []
        per_node = self.world // nodes
        axes = [axis for axis in reversed(AXES) if getattr(self, axis) > 1 and per_node % self.span(axis)]
        return axes + (["ep"] if self.experts_cross(nodes) else [])

    def experts_cross(self, nodes: int) -> bool:
        """Whether an expert-parallel group (:meth:`expert_groups`) has members on two of ``nodes`` nodes under block
        placement: then every MoE layer's all-to-alls leave the node, whether or not dp crosses (GPU review 3,
        finding 15). Enumerated: an ep group is not one block of consecutive ranks (its members are dp neighbours,
        ``cp x tp`` apart)."""
        if self.ep <= 1 or nodes <= 1:
            return False
        per_node = self.world // nodes
        return any(len({r // per_node for r in group}) > 1 for group in self.expert_groups()[0])

    def topology(self):
        """DeepSpeed's ``PipeModelDataParallelTopology`` of these degrees, ``data = dp x cp`` (imports deepspeed)."""
        from deepspeed.runtime.pipe.topology import PipeModelDataParallelTopology

        return PipeModelDataParallelTopology(num_pp=self.pp, num_mp=self.tp, num_dp=self.data)

    def batch_layout(self, global_batch_size: int, micro_batch_size: int) -> "BatchLayout":
        """How a global batch of ``global_batch_size`` samples is divided over these degrees."""
        return BatchLayout(global_batch_size, micro_batch_size, self.dp, self.cp)

    @staticmethod
    def _axis(axis: str) -> str:
        if axis not in AXES:
            raise ValueError(f"unknown axis {axis!r}; use one of {AXES}")
        return axis

    @classmethod
    def _index(cls, axis: str) -> int:
        return AXES.index(cls._axis(axis))


@dataclass(frozen=True)
class BatchLayout:
    """How one global batch is divided (all counts in samples): ``[accumulation, dp, micro_batch]``.

    Data-parallel rank ``r`` takes column ``r`` of every accumulation row; the ranks of the other axes
    (tensor-parallel peers, the pipeline's stages, the context-parallel ranks, which each keep their chunks of
    every row: :mod:`hybridtrain.parallel.context_parallel`) read the same rows as their replica's."""

    global_batch_size: int
    micro_batch_size: int
    dp: int
    cp: int = 1
    """Context-parallel ranks per replica: they read the same rows and each takes a share of every row's loss."""

    @property
    def averaged_over(self) -> int:
        """The ranks DeepSpeed averages each micro-batch's loss and gradient over: the data axis, ``dp x cp``."""
        return self.dp * self.cp

    @property
    def grad_accum(self) -> int:
        """Micro-batches per step on each data-parallel rank."""
        return self.global_batch_size // (self.micro_batch_size * self.dp)

    def rank_rows(self, indices: Any, dp_rank: int) -> Any:
        """This rank's micro-batches of one global batch's sample indices (a numpy array):
        ``[grad_accum, micro]``."""
        return indices.reshape(self.grad_accum, self.dp, self.micro_batch_size)[:, dp_rank]  # [gas, dp, mbs] -> [gas, mbs]


def pipeline_bubble(pp: int, micro_batches: int) -> float:
    """The idle share of a 1F1B (or GPipe) step: ``(pp - 1) / (m + pp - 1)`` for ``m`` micro-batches."""
    return (pp - 1) / (micro_batches + pp - 1)


def data_parallel_degree(dp: Optional[int], tp: int, pp: int, per_node: Optional[int], nodes: int,
                         cp: int = 1) -> int:
    """``dp`` of a run whose ``cp x tp x pp`` ranks per replica are placed on ``nodes`` nodes of ``per_node``
    devices (``None``: CPU processes, no device limit); ``dp=None`` fills the devices. Raises :class:`PlanError`
    naming the key and the fix when the product does not fit (the messages name cp only where it is > 1)."""
    model_ranks = tp * pp * cp
    names = "cp x tp x pp" if cp > 1 else "tp x pp"
    values = f"{cp} x {tp} x {pp}" if cp > 1 else f"{tp} x {pp}"
    if per_node is None:  # CPU processes: no device limit; dp defaults to one replica per node
        dp = dp or nodes
        if nodes > 1 and dp * model_ranks % nodes:
            raise PlanError("parallel.dp", f"dp x {names} = {dp * model_ranks} ranks do not spread evenly over "
                            f"launcher.nodes={nodes}")
        return dp
    total = per_node * nodes
    if model_ranks > total:
        key = "parallel.cp" if cp > 1 else "parallel.tp"
        raise PlanError(key, f"{names} = {values} = {model_ranks} ranks exceed the {total} devices "
                        f"(launcher.nodes={nodes} x launcher.gpus_per_node={per_node}); lower "
                        f"{'cp, ' if cp > 1 else ''}tp or pp, or add devices")
    chosen = dp if dp is not None else total // model_ranks
    world = chosen * model_ranks
    if (world != total) if dp is None else (world > total):
        raise PlanError("parallel.dp", f"dp x {names} = {chosen} x {values} = {world} does not fit the {total} "
                        f"devices (launcher.nodes={nodes} x launcher.gpus_per_node={per_node}); use dp <= "
                        f"{total // model_ranks}" + ("" if dp is not None else f" and {names} dividing {total}"))
    return chosen
