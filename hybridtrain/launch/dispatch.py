"""Which launcher starts a run: the controller's checks that read files or devices (:func:`check`) and
the hand-over to ``local``, ``slurm`` or ``multinode`` (:func:`start`). Not in the package's
``__init__``: the launchers import the rank's code (:mod:`hybridtrain.worker`), which imports the
package's helpers (``env``, ``devices``, ``placement``), so the package itself imports no launcher."""
from __future__ import annotations

from pathlib import Path

from hybridtrain.config.schema import LauncherConfig
from hybridtrain.plan.types import Machine, Plan


def check(launcher: LauncherConfig, plan: Plan, machine: Machine | None = None) -> None:
    """Launcher checks that read files or devices (the multinode hostfile; GPUs asked for but not seen
    by torch, :func:`hybridtrain.launch.devices.check_gpus`); raise ``PlanError`` before anything starts."""
    import os

    from hybridtrain.launch.devices import check_gpus, driver_gpus, rank_devices

    if launcher.name == "multinode":
        from hybridtrain.launch.multinode import hosts

        hosts(launcher, plan)
    if machine is not None and not launcher.dry_run:
        import torch

        check_gpus(launcher, machine.gpus_per_node, os.environ, driver_gpus(), torch.__version__)
        if launcher.name == "local":
            rank_devices(launcher, machine, plan.world_size, os.environ)  # CUDA_VISIBLE_DEVICES usable


def start(run_dir: Path, plan: Plan, launcher: LauncherConfig, machine: Machine, preloader=None) -> int:
    """Start (or submit) the run in ``run_dir`` with ``launcher.name``; return the exit code.
    ``preloader``: the local launcher's preload process, forked by the controller
    (:func:`hybridtrain.launch.preload.fork_preloader`)."""
    if launcher.name == "slurm":
        from hybridtrain.launch.slurm import submit

        return submit(run_dir, plan, launcher)
    if launcher.name == "multinode":
        from hybridtrain.launch.multinode import launch

        return launch(run_dir, plan, launcher, machine)
    from hybridtrain.launch.local import launch

    return launch(run_dir, plan, launcher, machine, preloader)
