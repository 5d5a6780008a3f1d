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
* :func:`cpu_ranks_env`, :func:`hide_gpus`: the ranks of a job of CPU processes (``launcher.gpus=false``
  on a GPU machine) see no GPU, whichever launcher starts them.
"""
from __future__ import annotations

from pathlib import Path
from typing import Mapping, MutableMapping, Optional

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


CPU_RANKS = {"CUDA_VISIBLE_DEVICES": "", "DS_ACCELERATOR": "cpu"}
"""The environment of every rank of a job of CPU processes: no GPU visible to torch, and DeepSpeed's CPU
accelerator (the worker then runs gloo, :mod:`hybridtrain.worker`). Without it a GPU machine's ranks see
its GPUs and DeepSpeed trains on them, with a plan made for CPU processes."""


def cpu_ranks_env(gpus: bool) -> dict[str, str]:
    """What a launcher adds to its ranks' environment: :data:`CPU_RANKS` unless they run on GPUs (``gpus``)."""
    return {} if gpus else dict(CPU_RANKS)


def hide_gpus(environ: MutableMapping[str, str]) -> None:
    """On a rank, before torch looks for CUDA: a rank of CPU processes (``DS_ACCELERATOR=cpu``, what
    :func:`cpu_ranks_env` gives) sees no GPU, even where its launcher listed some (DeepSpeed's
    ``launcher/launch.py``, which starts ``launcher=multinode``'s ranks, sets ``CUDA_VISIBLE_DEVICES`` to the
    node's slots for every accelerator, CPU included)."""
    if environ.get("DS_ACCELERATOR") == "cpu":
        environ["CUDA_VISIBLE_DEVICES"] = ""


def rank_devices(launcher: LauncherConfig, machine, world_size: int, environ: Mapping[str, str]) -> list[str]:
    """:func:`local_devices` of a ``launcher=local`` job planned for ``machine``: none for CPU processes
    (``launcher.gpus=false`` on a GPU machine, :func:`hybridtrain.plan.devices.uses_gpus`)."""
    from hybridtrain.plan.devices import uses_gpus

    return local_devices(world_size, environ, machine.gpus_per_node if uses_gpus(launcher, machine) else 0)


def local_devices(world_size: int, environ: Mapping[str, str], torch_gpus: int) -> list[str]:
    """The ``CUDA_VISIBLE_DEVICES`` entries the ranks of this node use, rank ``i`` the ``i``-th: the first
    ``world_size`` of the user's ``CUDA_VISIBLE_DEVICES`` (indices, UUIDs or MIG ids alike: the controller
    passes them on, :mod:`hybridtrain.launch.ranks`), else ``0..world_size-1`` (every GPU visible); none
    for CPU processes (``torch_gpus`` 0: the ranks get ``CUDA_VISIBLE_DEVICES=""``). The deepspeed runner's
    ``--num_gpus`` would drop the user's list and take GPUs ``0..N-1``."""
    visible = visible_devices(environ)
    if torch_gpus == 0:
        return []
    if not visible:
        return [str(i) for i in range(world_size)]
    if len(visible) < world_size:
        raise PlanError("launcher.gpus_per_node", f"{world_size} ranks but CUDA_VISIBLE_DEVICES="
                        f"{environ['CUDA_VISIBLE_DEVICES']} shows {len(visible)} GPU(s); show more GPUs or plan "
                        f"for {len(visible)} (launcher.gpus_per_node={len(visible)})")
    return visible[:world_size]


def slurm_device_index(environ: Mapping[str, str], local_id: int, tasks_on_node: int) -> int:
    """The CUDA device index of an ``srun`` task (DeepSpeed uses ``LOCAL_RANK`` as one).

    A task that sees every GPU of its node (or at least one per task there) uses the one of its local id.
    When SLURM binds one GPU to each task (``--gpus-per-task=1``, ``--gpu-bind=single:1``), the task's
    ``CUDA_VISIBLE_DEVICES`` lists only its own: index 0. A binding of ``1 < k <`` tasks GPUs per task
    (``--gpus-per-task=2``, ``--gpu-bind=closest`` on a node of two sockets) is refused with
    ``RuntimeError``: several tasks may then share the same ``k`` GPUs and none can tell which is its own,
    and index 0 for each put them all on one GPU (NCCL: "Duplicate GPU detected")."""
    visible = visible_devices(environ)
    if not visible or len(visible) >= tasks_on_node:
        return local_id
    if len(visible) == 1:
        return 0
    raise RuntimeError(f"SLURM bound task {local_id} of this node's {tasks_on_node} to {len(visible)} GPUs "
                       f"(CUDA_VISIBLE_DEVICES={environ['CUDA_VISIBLE_DEVICES']}): hybridtrain runs one rank per GPU and "
                       "cannot tell which of them is this task's (tasks sharing them would collide on one GPU); bind "
                       "one GPU per task (--gpus-per-task=1 or --gpu-bind=single:1 in launcher.sbatch) or none (drop "
                       "--gpus-per-task and --gpu-bind: every task then sees the node's GPUs)")


def slurm_gpus_expected(environ: Mapping[str, str]) -> bool:
    """Whether SLURM gave this job step GPUs (``SLURM_GPUS_ON_NODE`` > 0): its ranks must then see them."""
    try:
        return int(environ.get("SLURM_GPUS_ON_NODE", "0") or 0) > 0
    except ValueError:
        return False
