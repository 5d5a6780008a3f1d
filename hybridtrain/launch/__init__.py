"""Starting the workers: ``local`` (this machine), ``slurm`` (an sbatch job), ``multinode`` (the
deepspeed runner over several machines)."""
from __future__ import annotations

from pathlib import Path

from hybridtrain.config.schema import LauncherConfig
from hybridtrain.plan.types import Machine, Plan


def check(launcher: LauncherConfig, plan: Plan) -> None:
    """Launcher checks that read files (the multinode hostfile); raise ``PlanError`` before anything starts."""
    if launcher.name == "multinode":
        from hybridtrain.launch.multinode import hosts

        hosts(launcher, plan)


def start(run_dir: Path, plan: Plan, launcher: LauncherConfig, machine: Machine) -> int:
    """Start (or submit) the run in ``run_dir`` with ``launcher.name``; return the exit code."""
    if launcher.name == "slurm":
        from hybridtrain.launch.slurm import submit

        return submit(run_dir, plan, launcher)
    if launcher.name == "multinode":
        from hybridtrain.launch.multinode import launch
    else:
        from hybridtrain.launch.local import launch
    return launch(run_dir, plan, launcher, machine)
