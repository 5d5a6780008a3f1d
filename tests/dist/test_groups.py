"""``parallel/groups.py`` in a real gloo world of 4 ranks: the groups :class:`ParallelGroups` hands out hold
exactly the ranks :class:`ParallelDims` says (an all-reduce of each rank's number over each group), its mpu
answers equal DeepSpeed's grid's, and an axis DeepSpeed's grid lacks (``cp``) gets groups of its own that
lie inside DeepSpeed's data axis. Every group, DeepSpeed's included, times out as the world group does
(:func:`~hybridtrain.parallel.groups.time_out_groups_like_world`)."""
from __future__ import annotations

import pytest

from hybridtrain.parallel.dims import ParallelDims
from hybridtrain.parallel.spawn import run_world

LAYOUTS = {"dp2_tp2": dict(dp=2, tp=2), "cp2_tp2": dict(cp=2, tp=2), "dp2_cp2": dict(dp=2, cp=2)}
WORLD = 4
TIMEOUT_S = 4321  # neither torch's gloo default (1800 s) nor the harness's world timeout (120 s)


def _members(group, rank: int):
    """The global ranks of ``group`` as every member sees them: each member contributes a one-hot row."""
    import torch

    from hybridtrain.parallel import collectives

    if group is None:
        return [rank]
    onehot = torch.zeros(WORLD)
    onehot[rank] = 1
    return [int(r) for r in collectives.all_reduce(onehot, "cpu", group=group).nonzero().flatten()]


def _timeout_s(group) -> float:
    import torch

    options = group._get_backend(torch.device("cpu")).options
    return options._timeout.total_seconds()


def _probe(rank: int, world: int, emit) -> None:
    from datetime import timedelta

    from hybridtrain.parallel.context import TPContext
    from hybridtrain.parallel.groups import sequential_groups, time_out_groups_like_world

    time_out_groups_like_world(timedelta(seconds=TIMEOUT_S))
    for name, degrees in LAYOUTS.items():
        groups = sequential_groups(ParallelDims(**degrees), TPContext())
        grid = groups._grid  # DeepSpeed's own answers, to compare the protocol with
        emit(name, {
            "data": _members(groups.data_group, rank), "model": _members(groups.model_group, rank),
            "tp": _members(groups.tp.group, rank), "cp": _members(groups.cp.group, rank),
            "ours": [groups.get_data_parallel_rank(), groups.get_data_parallel_world_size(),
                     groups.get_model_parallel_rank(), groups.get_model_parallel_world_size(),
                     groups.get_slice_parallel_rank(), groups.get_slice_parallel_world_size(),
                     groups.get_pipe_parallel_rank(), groups.get_pipe_parallel_world_size(),
                     groups.get_data_parallel_group_ranks()],
            "deepspeed": [grid.get_data_parallel_rank(), grid.get_data_parallel_world_size(),
                          grid.get_model_parallel_rank(), grid.get_model_parallel_world_size(),
                          grid.get_slice_parallel_rank(), grid.get_slice_parallel_world_size(),
                          grid.get_pipe_parallel_rank(), grid.get_pipe_parallel_world_size(),
                          grid.get_data_parallel_group_ranks()],
            "cp_rank": [groups.cp.rank, groups.cp.size],
            "sequence_axis": [hasattr(groups, f"get_sequence_{what}") for what in (
                "parallel_group", "parallel_world_size", "data_parallel_group", "data_parallel_world_size")],
            "timeouts": [_timeout_s(g) for g in (grid.get_data_parallel_group(), grid.get_slice_parallel_group(),
                                                 grid.get_pipe_parallel_group(), groups.tp.group,
                                                 groups.cp.group) if g is not None],
        })


@pytest.fixture(scope="module")
def world():
    run = run_world(_probe, WORLD, timeout_s=120)
    assert not run.problems, run.problem_report()
    return run


@pytest.mark.parametrize("name", sorted(LAYOUTS))
def test_groups_hold_the_ranks_the_axes_say(world, name):
    dims = ParallelDims(**LAYOUTS[name])
    for rank in range(WORLD):
        got, c = world.emitted[rank][name], dims.coords(rank)
        assert got["data"] == dims.data_group_of(rank)  # ZeRO's group covers dp x cp
        assert got["sequence_axis"] == [False] * 4  # DeepSpeed sees dp x cp as one data axis (ParallelGroups)
        assert got["tp"] == dims.group_of("tp", rank)
        assert got["cp"] == dims.group_of("cp", rank)
        assert got["model"] == [r for r in range(WORLD) if (dims.coords(r).dp, dims.coords(r).cp) == (c.dp, c.cp)]
        assert got["ours"] == got["deepspeed"]  # the mpu protocol answers as DeepSpeed's grid does
        assert got["cp_rank"] == [c.cp, dims.cp]


def test_every_group_times_out_as_the_world_does(world):
    for rank in range(WORLD):
        for name in LAYOUTS:
            timeouts = world.emitted[rank][name]["timeouts"]
            assert len(timeouts) >= 3 and set(timeouts) == {TIMEOUT_S}, (rank, name, timeouts)
