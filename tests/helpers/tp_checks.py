"""The spawned-world layer tests' shared parts (tests/dist/test_tp_layers.py, test_lora_layers.py):
run every case at every tensor-parallel degree in the child ranks, and check what each rank emitted."""
from __future__ import annotations

import traceback
from typing import Callable, Mapping, Sequence

import pytest
import torch

from hybridtrain.parallel.spawn import WorldRun


def case_key(tp: int, case: str) -> str:
    return f"tp{tp}-{case}"


def run_cases_at_degrees(cases: Mapping[str, Callable], degrees: Sequence[int], rank: int, emit) -> None:
    """In a child rank: every case at every degree; a failing case emits its traceback.

    TP group of degree ``n`` = ranks ``[0, n)``; the others skip those cases. Cases run in the
    same order on every member, so an exception raised on all ranks (the usual kind) leaves
    them in step; a one-sided one hangs a peer until the harness kills it.
    """
    import torch.distributed as dist

    from hybridtrain.parallel.context import TPContext

    groups = {n: dist.new_group(list(range(n))) for n in degrees}  # collective: every rank calls it
    for n in sorted(degrees, reverse=True):
        if rank >= n:
            continue
        tp = TPContext(group=groups[n], rank=rank, size=n)
        for name, case in cases.items():
            try:
                emit(case_key(n, name), case(tp))
            except Exception:
                emit(case_key(n, name), f"tp={n} rank {rank}, case {name} raised:\n{traceback.format_exc()}")


def emitted_checks(world_run: WorldRun, rank: int, key: str, where: str = "") -> dict:
    """The checks ``name -> (got, want)`` rank ``rank`` emitted under ``key``; fails the test with the world's
    problem report when it emitted nothing, or with the child's traceback when the case raised."""
    emitted = world_run.emitted[rank]
    if key not in emitted:
        pytest.fail(f"{where}rank {rank} returned nothing for {key}:\n{world_run.problem_report()}")
    if isinstance(emitted[key], str):  # the child's traceback
        pytest.fail(emitted[key])
    return emitted[key]


def assert_rank_checks(world_run: WorldRun, tp: int, case: str, rel: float, approx_floats: bool = False) -> None:
    """Every check ``name -> (got, want)`` each rank of degree ``tp`` emitted for ``case``: tensors within
    ``rel`` of the largest entry (at least 1), floats approximately with ``approx_floats``, the rest equal."""
    for rank in range(tp):
        checks = emitted_checks(world_run, rank, case_key(tp, case), f"tp={tp} ")
        for check, (got, want) in checks.items():
            where = f"tp={tp} rank {rank} {case}: {check}"
            if isinstance(want, torch.Tensor):
                assert got is not None, f"{where}: no gradient"
                scale = max(1.0, want.abs().max().item())
                torch.testing.assert_close(got, want, rtol=rel, atol=rel * scale, msg=lambda m: f"{where}\n{m}")
            elif approx_floats and isinstance(want, float):
                assert got == pytest.approx(want), where
            else:
                assert got == want, where
