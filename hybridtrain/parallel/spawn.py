"""Run one function on ``world`` gloo ranks in spawned processes and collect what each rank emits:
what the family self-check (:mod:`hybridtrain.models.selfcheck`) and the tensor-parallel layer tests
(``tests/dist/test_tp_layers.py``) run.

Why by hand: ``torch.multiprocessing.spawn`` re-raises only the first child error and waits
forever on a rank stuck in a collective; DeepSpeed's runner launches whole scripts. Tests here
need every rank's results, the failing rank's traceback, and a hard deadline.

Each rank initialises ``torch.distributed`` (gloo, TCP on a free localhost port) and then
``deepspeed.comm`` on top of it, because DeepSpeed's autograd collectives
(``deepspeed.module_inject.layers.ColumnParallel``/``RowParallel``) and its vocabulary-parallel
cross-entropy call ``deepspeed.comm``, which asserts unless ``deepspeed.init_distributed`` ran.
A rank hands results back through ``emit(key, value)``: one ``torch.save`` file per key,
written at once, so what was emitted before a crash or a hang still reaches the parent.
"""
from __future__ import annotations

import importlib
import os
import shutil
import tempfile
import time
import traceback
from dataclasses import dataclass, field
from datetime import timedelta
from pathlib import Path
from typing import Any, Callable, Dict, List

import torch
import torch.multiprocessing as mp

from hybridtrain.ports import free_port

Emit = Callable[[str, Any], None]
Target = Callable[[int, int, Emit], None]
"""``target(rank, world, emit)``: a module-level function (the spawned child imports it by name)."""

_FATAL = "fatal.txt"
_DONE = "done"  # the target returned on every rank: what follows is teardown


@dataclass
class WorldRun:
    """What every rank emitted, and why the run ended badly if it did."""

    world: int
    emitted: List[Dict[str, Any]]
    """``emitted[rank][key]``: the value rank ``rank`` passed to ``emit(key, ...)``."""
    problems: List[str] = field(default_factory=list)
    """Per-rank fatal tracebacks, non-zero exit codes and timeouts; empty for a clean run."""

    def problem_report(self) -> str:
        return "\n".join(self.problems) if self.problems else "(all ranks exited cleanly)"


def run_world(target: Target, world: int, timeout_s: float = 120.0, grace_s: float = 5.0,
              deepspeed_comm: bool = True) -> WorldRun:
    """Spawn ``world`` ranks running ``target`` and wait at most ``timeout_s`` seconds.

    When one rank dies, the others get ``grace_s`` seconds (they are usually blocked in a
    collective with it) and are then killed, so a failure never hangs the test session.
    ``deepspeed_comm=False`` skips ``deepspeed.init_distributed`` (plain ``torch.distributed``).
    """
    out = Path(tempfile.mkdtemp(prefix=f"tp_world{world}_"))
    ctx = mp.get_context("spawn")
    port = free_port()
    procs = [ctx.Process(target=_child, args=(target, rank, world, port, str(out), deepspeed_comm),
                         daemon=True) for rank in range(world)]
    try:
        for p in procs:
            p.start()
        problems = _wait(procs, time.monotonic() + timeout_s, grace_s)
        emitted: List[Dict[str, Any]] = []
        for rank in range(world):
            rank_dir = out / f"rank{rank}"
            if (rank_dir / _DONE).exists():
                # Gloo's threads can abort the interpreter's exit ("terminate called without an active
                # exception") after every rank returned and emitted everything: not a failure of the run.
                problems = [p for p in problems if not p.startswith(f"rank {rank} exited with code")]
            fatal = rank_dir / _FATAL
            if fatal.exists():
                problems.append(f"rank {rank} raised:\n{fatal.read_text()}")
            emitted.append({f.stem: torch.load(f, weights_only=True) for f in sorted(rank_dir.glob("*.pt"))})
        return WorldRun(world, emitted, problems)
    finally:  # also on KeyboardInterrupt: leave no rank behind
        for p in procs:
            if p.is_alive():
                p.kill()
                p.join(5)
        shutil.rmtree(out, ignore_errors=True)


def _wait(procs, deadline: float, grace_s: float) -> List[str]:
    problems: List[str] = []
    while time.monotonic() < deadline and any(p.is_alive() for p in procs):
        if any(p.exitcode not in (None, 0) for p in procs):  # one died: peers are likely stuck
            deadline = min(deadline, time.monotonic() + grace_s)
        time.sleep(0.05)
    for rank, p in enumerate(procs):
        if p.is_alive():
            p.kill()
            p.join(5)
            problems.append(f"rank {rank} killed: still running at the deadline (hung collective?)")
        elif p.exitcode != 0:
            problems.append(f"rank {rank} exited with code {p.exitcode}")
    return problems


def _child(target: Target, rank: int, world: int, port: int, out: str, deepspeed_comm: bool) -> None:
    rank_dir = Path(out) / f"rank{rank}"
    rank_dir.mkdir(parents=True, exist_ok=True)
    try:
        torch.set_num_threads(1)  # ranks share 2 cores
        os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port), RANK=str(rank),
                          WORLD_SIZE=str(world), LOCAL_RANK=str(rank))
        torch.distributed.init_process_group("gloo", init_method=f"tcp://127.0.0.1:{port}", rank=rank,
                                             world_size=world, timeout=timedelta(seconds=120))
        if deepspeed_comm:
            # deepspeed.comm's TorchBackend JIT-builds a CPU shared-memory all-reduce (slow,
            # docs/benchmarks.md) that gloo does not need.
            importlib.import_module("deepspeed.comm.torch").build_shm_op = lambda: None
            import deepspeed

            # torch.distributed is already up, so this only wraps it (deepspeed.comm's ``cdb``).
            deepspeed.init_distributed(dist_backend="gloo", verbose=False)

        def emit(key: str, value: Any) -> None:
            tmp = rank_dir / f"{key}.tmp"
            torch.save(value, tmp)
            tmp.rename(rank_dir / f"{key}.pt")  # the parent never reads a half-written file

        target(rank, world, emit)
        from hybridtrain.parallel.collectives import barrier

        barrier("cpu")  # no rank tears gloo down while a peer still sends to it
        (rank_dir / _DONE).touch()
        torch.distributed.destroy_process_group()
    except BaseException:
        (rank_dir / _FATAL).write_text(traceback.format_exc())
        raise SystemExit(1)
