"""The local launcher: one process per rank on this machine, started and watched by the controller
(:mod:`hybridtrain.launch.ranks`); the deepspeed runner for ``launcher=multinode``."""
from __future__ import annotations

import os
import signal
import sys
from pathlib import Path

from hybridtrain.config.schema import LauncherConfig
from hybridtrain.launch.output import LOG_NAME, Output
from hybridtrain.launch.preload import Preloader
from hybridtrain.launch.ranks import Ranks, rank_env
from hybridtrain.plan.types import Machine, Plan
from hybridtrain.ports import free_port


def threads_per_rank(launcher: LauncherConfig, plan: Plan, machine: Machine) -> int:
    """CPU threads for each worker so the ranks of this node do not oversubscribe its cores."""
    if launcher.threads_per_rank:
        return launcher.threads_per_rank
    local_ranks = plan.world_size // plan.nodes
    return max(1, machine.cpu_cores // local_ranks)


def command(run_dir: Path) -> list[str]:
    """The command of every rank (its place comes from the environment, :func:`~hybridtrain.launch.ranks.rank_env`)."""
    return [sys.executable, "-u", "-m", "hybridtrain.worker", str(run_dir)]


def early_preloader(launcher: LauncherConfig, environ) -> Preloader | None:
    """The preload process for a local run, forked from the controller now, before it plans
    (:func:`~hybridtrain.launch.preload.fork_preloader`): its CPU ranks are forked from that process,
    which imports their libraries once. None for another launcher, a dry run, a machine with CUDA
    (GPU ranks are never forked) and ``HYBRIDTRAIN_PRELOAD=0``: then every rank is its own interpreter."""
    if launcher.name != "local" or launcher.dry_run or environ.get("HYBRIDTRAIN_PRELOAD", "1") == "0":
        return None
    from hybridtrain.launch.preload import fork_preloader

    return fork_preloader()


def launch(run_dir: Path, plan: Plan, launcher: LauncherConfig, machine: Machine,
           preloader: Preloader | None = None) -> int:
    """Start ``plan.world_size`` workers on this machine and watch them (:mod:`hybridtrain.launch.ranks`);
    return the job's exit code. ``preloader`` (:func:`early_preloader`): the process to fork the CPU
    ranks from; without one every rank starts as its own interpreter.

    Workers find everything in ``run_dir`` (``config.yaml``, ``plan.json``, ``data.json``). A rank
    that fails ends every other rank, so a dead rank ends the job with a non-zero code. Ctrl-C and
    SIGTERM are forwarded to the ranks (:meth:`~hybridtrain.launch.ranks.Ranks.forward`).
    """
    if launcher.nodes != 1:
        raise SystemExit(f"launcher.nodes={launcher.nodes}: the local launcher runs on one machine; "
                         "use launcher.nodes=1")
    port = launcher.master_port or free_port()
    threads = threads_per_rank(launcher, plan, machine)
    env = dict(os.environ, HYBRIDTRAIN_THREADS=str(threads), OMP_NUM_THREADS=str(threads),
               PYTHONUNBUFFERED="1")
    world, cmd = plan.world_size, command(run_dir)
    from hybridtrain.launch.devices import rank_devices

    devices = rank_devices(launcher, machine, world, os.environ)  # the user's CUDA_VISIBLE_DEVICES kept; CPU: none
    fork = preloader is not None  # never on a machine with CUDA (early_preloader)
    shown = [f"(fork of {os.getpid()})", "hybridtrain.launch.preload.serve", str(run_dir)] if fork else cmd
    where = f": {' '.join(shown)}" if launcher.verbose else f"; DeepSpeed's output in {run_dir / LOG_NAME}"
    how = " forked after one import" if fork else ""
    print(f"[hybridtrain] launching {world} rank(s){how}, {threads} thread(s) each{where}", flush=True)
    out, ranks = Output(run_dir, launcher.verbose, shown), Ranks()
    old = {s: signal.signal(s, ranks.forward) for s in (signal.SIGINT, signal.SIGTERM)}
    envs = [rank_env(env, r, world, port, devices) for r in range(world)]
    try:
        try:
            if fork:
                ranks.fork(run_dir, env, envs, out.stdout, preloader)
            else:
                ranks.start(cmd, envs, out.stdout)
        finally:
            out.started()
        code = ranks.wait()
    except BaseException:  # the controller itself failed: leave no rank behind
        ranks.terminate(grace=0)
        raise
    finally:
        for s, h in old.items():
            signal.signal(s, h)
        out.finish()
    return report_stop(run_dir, code)


def report_stop(run_dir: Path, code: int) -> int:
    """After the ranks exited: if they stopped on a signal with a checkpoint, say so and return 0."""
    from hybridtrain.train.preempt import take_marker

    stopped = take_marker(run_dir)
    if stopped is None:
        return code
    print(f"[hybridtrain] stopped early after step {stopped['step']} with checkpoint {stopped['checkpoint']}; "
          f"continue with trainer.resume=auto hydra.run.dir={run_dir}", flush=True)
    return 0
