"""Where each rank sits: its node and its (dp, tp, pp) coordinates, and which groups cross nodes.

The coordinates come from :class:`~hybridtrain.parallel.dims.ParallelDims` (DeepSpeed's topology,
``tp`` fastest, then ``dp``, then ``pp``; checked against DeepSpeed in tests/unit/test_multinode.py).
Launchers put ``k = world / nodes`` consecutive ranks on each node, so a TP group (``tp`` consecutive ranks) stays inside a node when ``tp`` divides ``k``, and a
data-parallel group (stride ``tp``, ``dp`` members) when ``dp x tp`` divides ``k``; the pipeline axis,
outermost, is what crosses nodes first.
"""
from __future__ import annotations

from dataclasses import dataclass
from typing import Optional, Sequence

from hybridtrain.parallel.dims import Coords
from hybridtrain.plan.types import Plan


@dataclass(frozen=True)
class Place:
    """One rank's node and coordinates."""

    rank: int
    node: int
    coords: Coords


def places(plan: Plan) -> list[Place]:
    """Every rank's :class:`Place` under block placement (``world / nodes`` consecutive ranks per node)."""
    per_node = plan.world_size // plan.nodes
    return [Place(rank=r, node=r // per_node, coords=c) for r, c in enumerate(plan.dims.all_coords())]


def crossing(plan: Plan) -> list[str]:
    """The parallel axes whose groups span more than one node (``tp``, ``dp``, ``pp``):
    :meth:`~hybridtrain.parallel.dims.ParallelDims.crossing`, which the plan checks too."""
    return plan.dims.crossing(plan.nodes)


def describe(plan: Plan, node_names: Optional[Sequence[str]] = None) -> str:
    """The rank map printed at start-up: one line per rank, then which groups cross nodes."""
    names = list(node_names or [f"node{i}" for i in range(plan.nodes)])
    lines = [f"[hybridtrain] rank map ({plan.nodes} node(s) x {plan.world_size // plan.nodes} rank(s)):"]
    shown = plan.dims.shown_axes()
    lines += [f"[hybridtrain]   rank {p.rank:>4}  node {names[p.node]:<12} "
              + "  ".join(f"{axis} {getattr(p.coords, axis)}" for axis in shown) for p in places(plan)]
    cross = crossing(plan)
    lines.append("[hybridtrain]   groups crossing nodes: " + (", ".join(cross) if cross else "none")
                 + ("  (tensor-parallel traffic leaves the node: use tp <= ranks per node)" if "tp" in cross else "")
                 + ("  (every MoE layer's expert all-to-all leaves the node: use an ep whose groups fit a node)"
                    if "ep" in cross else ""))
    return "\n".join(lines)
