"""Inside a SLURM job step: the torch.distributed environment of one rank, from SLURM's variables.

``srun`` starts one task per rank and tells each its place (``SLURM_PROCID``, ``SLURM_LOCALID``,
``SLURM_NTASKS``, ``SLURM_NODEID``, ``SLURM_JOB_NODELIST``); ``torch.distributed``'s ``env://``
rendezvous (what ``deepspeed.init_distributed`` uses) wants ``RANK``, ``LOCAL_RANK``,
``WORLD_SIZE``, ``MASTER_ADDR`` and ``MASTER_PORT`` (``LOCAL_RANK`` is the CUDA device index:
``SLURM_LOCALID``, or 0 when SLURM binds each task its own GPU). :func:`rank_env` is the translation, a pure
function of the environment; :func:`apply` runs it at the worker's launch boundary.
"""
from __future__ import annotations

import os
import subprocess
from typing import Callable, Mapping, MutableMapping, Optional, Sequence

from hybridtrain.launch.devices import slurm_device_index


def hostnames(nodelist: str) -> list[str]:
    """The node names of a SLURM node list (``node[1-2]`` -> ``['node1', 'node2']``), in SLURM's order.

    ``scontrol show hostnames`` expands it locally, without asking the controller; SLURM's own
    parser is used rather than a hand-written one because node-list syntax has many forms.
    """
    out = subprocess.run(["scontrol", "show", "hostnames", nodelist], capture_output=True, text=True, check=True)
    return out.stdout.split()


def job_port(job_id: int) -> int:
    """The rendezvous port of a job: 20000 + job id modulo 12000, so jobs sharing a node differ, and
    below Linux's default ephemeral range (32768 on), which outgoing connections take ports from
    (:mod:`hybridtrain.ports`)."""
    return 20000 + job_id % 12000


def rank_env(environ: Mapping[str, str], expand: Callable[[str], Sequence[str]] = hostnames,
             master_port: Optional[int] = None) -> dict[str, str]:
    """The ``env://`` variables of this task, derived from SLURM's.

    Ranks are placed in blocks (``srun --distribution=block``): node ``n`` holds ranks
    ``n * k .. n * k + k - 1`` with ``k = SLURM_NTASKS / SLURM_NNODES``. That is the order DeepSpeed's
    topology assumes when it keeps tensor-parallel peers on adjacent ranks, so a task found on
    another node raises ``RuntimeError`` instead of silently sending TP traffic across nodes.
    """
    rank, world = int(environ["SLURM_PROCID"]), int(environ["SLURM_NTASKS"])
    nodes = expand(environ["SLURM_JOB_NODELIST"])
    n_nodes = int(environ.get("SLURM_NNODES", len(nodes)))
    per_node = world // n_nodes
    node_id = int(environ["SLURM_NODEID"])
    if world % n_nodes or node_id != rank // per_node:
        raise RuntimeError(f"SLURM placed rank {rank} of {world} on node {node_id} of {n_nodes}; hybridtrain needs "
                           f"{per_node} consecutive ranks per node (srun --distribution=block, --ntasks-per-node)")
    port = master_port or job_port(int(environ["SLURM_JOB_ID"]))
    # DeepSpeed takes LOCAL_RANK as the CUDA device index; with GPUs bound per task it is 0
    local = slurm_device_index(environ, int(environ["SLURM_LOCALID"]), per_node)
    return {"RANK": str(rank), "LOCAL_RANK": str(local), "WORLD_SIZE": str(world),
            "LOCAL_WORLD_SIZE": str(per_node), "MASTER_ADDR": nodes[0], "MASTER_PORT": str(port),
            "HYBRIDTRAIN_NODES": ",".join(nodes)}


def threads(environ: Mapping[str, str]) -> int:
    """CPU threads for this task: ``HYBRIDTRAIN_THREADS`` if set, else ``SLURM_CPUS_PER_TASK``, else the
    job's CPUs on this node divided by its tasks there."""
    for key in ("HYBRIDTRAIN_THREADS", "SLURM_CPUS_PER_TASK"):
        if int(environ.get(key, "0") or 0) > 0:
            return int(environ[key])
    cpus = int(environ.get("SLURM_CPUS_ON_NODE", "1"))
    tasks = int(environ["SLURM_NTASKS"]) // int(environ.get("SLURM_NNODES", "1"))
    return max(1, cpus // max(1, tasks))


def apply(environ: MutableMapping[str, str] = os.environ) -> None:
    """Set this rank's ``env://`` variables and thread count from SLURM's (the worker calls it when the
    job script marks the step with ``HYBRIDTRAIN_LAUNCHER=slurm``)."""
    port = environ.get("HYBRIDTRAIN_MASTER_PORT")
    environ.update(rank_env(environ, master_port=int(port) if port else None))
    n = str(threads(environ))
    environ["HYBRIDTRAIN_THREADS"] = n
    environ["OMP_NUM_THREADS"] = n
