"""Per-rank numbers to every rank (rank 0 uses them) with one fixed-shape collective.

Every rank calls these at the same steps (the loop's log steps and the last profiled step), so
they add no new way to hang: the collective is on the world group, like the loop's other
per-step traffic. Fixed-shape float64 tensors rather than ``all_gather_object``: no pickling,
and the same code on gloo and NCCL (the tensor lives on the engine's device).
"""
from __future__ import annotations

from typing import Sequence

RANK_FIELDS = ("stage", "forward_s", "backward_s", "comm_s", "optimizer_s", "data_wait_s", "step_time_s",
               "rss_bytes", "gpu_peak_bytes", "gpu_util", "model_state_bytes")
"""The per-rank vector of a log step, in order (``-1`` marks "not available")."""

EVENT_WIDTH = 5
"""An event row: step, kind index, micro-batch, start_s, end_s."""


def all_ranks(values: Sequence[float], device) -> list[list[float]]:
    """``values`` of every rank, indexed by global rank (the same list on every rank)."""
    import torch

    from hybridtrain.parallel import collectives

    mine = torch.tensor([float(v) for v in values], dtype=torch.float64, device=device)
    return [t.tolist() for t in collectives.all_gather(mine, device)]


def all_rows(rows: Sequence[Sequence[float]], width: int, device) -> list[list[list[float]]]:
    """Every rank's list of ``width``-long rows (lengths may differ), indexed by global rank."""
    import torch

    from hybridtrain.parallel import collectives

    n = torch.tensor([len(rows)], dtype=torch.int64, device=device)
    longest = int(collectives.all_reduce(n, device, op="max").item())
    padded = torch.full((longest, width), float("nan"), dtype=torch.float64, device=device)
    if rows:
        padded[:len(rows)] = torch.tensor([list(map(float, r)) for r in rows], dtype=torch.float64, device=device)
    gathered = collectives.all_gather(padded, device)
    return [[r for r in g.tolist() if r[0] == r[0]] for g in gathered]  # drop NaN padding rows
