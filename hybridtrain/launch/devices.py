"""Which GPUs a job's ranks use, and the refusal to train on CPU cores when GPUs were meant.

Pure functions of the environment (and of what torch and the NVIDIA driver report, passed in), so
each rule is unit-tested without a GPU:

* :func:`local_devices`: the devices the ranks of this node get, so that a user's
  ``CUDA_VISIBLE_DEVICES`` is honoured (the deepspeed runner's ``--num_gpus`` ignores and drops it:
  ``deepspeed/launcher/runner.py`` ``main``).
* :func:`check_gpus`: a job that asked for GPUs (see :func:`asked_for_gpus`) on a machine where
  torch sees none stops before launching with exit code 2, instead of training on CPU cores.
* :func:`slurm_device_index`: the CUDA device index of an ``srun`` task, which is what DeepSpeed
  reads from ``LOCAL_RANK``.
"""
from __future__ import annotations

from pathlib import Path
from typing import Mapping, Optional

from hybridtrain.config.schema import LauncherConfig
from hybridtrain.errors import PlanError

HIDDEN = ("", "-1", "none", "void")
"""``CUDA_VISIBLE_DEVICES`` values that hide every GPU on purpose (the CPU test tiers set ``""``)."""


def visible_devices(environ: Mapping[str, str]) -> Optional[list[str]]:
    """The entries of ``CUDA_VISIBLE_DEVICES``; ``None`` when it is unset, ``[]`` when it hides every GPU."""
    value = environ.get("CUDA_VISIBLE_DEVICES")
    if value is None:
        return None
    if value.strip().lower() in HIDDEN:
        return []
    return [v.strip() for v in value.split(",") if v.strip()]


def driver_gpus(root: Path = Path("/proc/driver/nvidia/gpus")) -> int:
    """GPUs the NVIDIA driver of this machine lists (one folder per GPU), whatever torch sees."""
    try:
        return sum(1 for _ in root.iterdir())
    except OSError:
        return 0


def asked_for_gpus(launcher: LauncherConfig, environ: Mapping[str, str], driver: int) -> bool:
    """Whether this job means to run on GPUs: ``launcher.gpus=true`` (GPU recipes set it), or, with
    ``launcher.gpus`` null, a machine whose NVIDIA driver lists ``driver`` > 0 GPUs that
    ``CUDA_VISIBLE_DEVICES`` does not hide. ``launcher.gpus=false`` asks for CPU processes."""
    if launcher.gpus is not None:
        return bool(launcher.gpus)
    return driver > 0 and visible_devices(environ) != []


def check_gpus(launcher: LauncherConfig, torch_gpus: int, environ: Mapping[str, str], driver: int,
               torch_version: str = "") -> None:
    """Raise :class:`PlanError` (exit 2, before launching) when this job asked for GPUs and torch
    sees none here. ``launcher=slurm`` runs on other machines: its ranks check there
    (:func:`hybridtrain.worker` with ``SLURM_GPUS_ON_NODE``); a dry run launches nothing."""
    if launcher.dry_run or launcher.name == "slurm" or torch_gpus > 0:
        return
    if not asked_for_gpus(launcher, environ, driver):
        return
    why = ("launcher.gpus=true" if launcher.gpus else
           f"the NVIDIA driver lists {driver} GPU(s) on this machine")
    raise PlanError("launcher.gpus", f"{why} but torch {torch_version} sees no CUDA device (a CPU build of torch, "
                    "a CUDA build that does not match the driver, or CUDA_VISIBLE_DEVICES naming no GPU); "
                    "install the CUDA build (bash scripts/install.sh --cuda 12.4, docs/gpu.md), or train on CPU "
                    "processes with launcher.gpus=false")


def local_devices(world_size: int, environ: Mapping[str, str], torch_gpus: int) -> list[str]:
    """The ``CUDA_VISIBLE_DEVICES`` entries the ranks of this node use, rank ``i`` the ``i``-th: the first
    ``world_size`` of the user's ``CUDA_VISIBLE_DEVICES`` (indices, UUIDs or MIG ids alike: the controller
    passes them on, :mod:`hybridtrain.launch.ranks`), else ``0..world_size-1`` (CPU processes, or every GPU
    visible). The deepspeed runner's ``--num_gpus`` would drop the user's list and take GPUs ``0..N-1``."""
    visible = visible_devices(environ)
    if torch_gpus == 0 or not visible:
        return [str(i) for i in range(world_size)]
    if len(visible) < world_size:
        raise PlanError("launcher.gpus_per_node", f"{world_size} ranks but CUDA_VISIBLE_DEVICES="
                        f"{environ['CUDA_VISIBLE_DEVICES']} shows {len(visible)} GPU(s); show more GPUs or plan "
                        f"for {len(visible)} (launcher.gpus_per_node={len(visible)})")
    return visible[:world_size]


def slurm_device_index(environ: Mapping[str, str], local_id: int, tasks_on_node: int) -> int:
    """The CUDA device index of an ``srun`` task (DeepSpeed uses ``LOCAL_RANK`` as one).

    A task that sees every GPU of its node uses the one of its local id. When SLURM binds GPUs to
    tasks (``--gpus-per-task``, ``--gpu-bind``), each task's ``CUDA_VISIBLE_DEVICES`` lists only its
    own, fewer than the tasks on the node, and the task uses the first of them: index 0."""
    visible = visible_devices(environ)
    if visible and len(visible) < tasks_on_node:
        return 0
    return local_id


def slurm_gpus_expected(environ: Mapping[str, str]) -> bool:
    """Whether SLURM gave this job step GPUs (``SLURM_GPUS_ON_NODE`` > 0): its ranks must then see them."""
    try:
        return int(environ.get("SLURM_GPUS_ON_NODE", "0") or 0) > 0
    except ValueError:
        return False
