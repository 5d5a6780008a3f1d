"""The multi-node launcher without SLURM: DeepSpeed's runner over several machines.

Two ways (docs/slurm.md#without-slurm):

- ``launcher.hostfile``: one command on the first machine; the runner reaches every host of the
  DeepSpeed hostfile (``host slots=N``) over ssh with pdsh and starts its ranks there.
- ``launcher.no_ssh=true``: the same command on every machine, each with its ``launcher.node_rank``
  and the same ``launcher.master_addr``; each runner starts only its own node's ranks
  (DeepSpeed's ``--no_ssh --node_rank``).

Either way ranks are numbered node by node in hostfile order, so each node holds consecutive
ranks (see :mod:`hybridtrain.launch.placement`). The run directory must be the same path on
every machine (a shared filesystem): checkpoints are written there by every rank.
"""
from __future__ import annotations

import os
import signal
import subprocess
import sys
from pathlib import Path

from hybridtrain.config.schema import MultinodeLauncherConfig
from hybridtrain.launch.devices import cpu_ranks_env
from hybridtrain.launch.local import report_stop, threads_per_rank
from hybridtrain.launch.output import Output
from hybridtrain.launch.parent import Lifeline, controller_env, parent_death
from hybridtrain.errors import PlanError
from hybridtrain.plan.devices import uses_gpus
from hybridtrain.plan.types import Machine, Plan
from hybridtrain.rundir import RunDir

DEFAULT_PORT = 29500  # DeepSpeed's; every node must use the same port, so none is picked at random


def hosts(launcher: MultinodeLauncherConfig, plan: Plan) -> list[tuple[str, int]]:
    """``(host, slots)`` of every node in rank order; raise :class:`PlanError` when the hostfile does not
    match ``launcher.nodes`` and the plan's ranks per node."""
    per_node = plan.world_size // plan.nodes
    if launcher.hostfile is None:  # no_ssh: the names only label the nodes
        return [(f"node{i}", per_node) for i in range(plan.nodes)]
    from deepspeed.launcher.runner import fetch_hostfile  # DeepSpeed's own parser of its format

    path = Path(launcher.hostfile).expanduser()
    pool = fetch_hostfile(str(path)) if path.is_file() else None
    if not pool:
        raise PlanError("launcher.hostfile", f"{launcher.hostfile!r} is missing or has no 'host slots=N' line")
    found = list(pool.items())
    if len(found) != plan.nodes or any(slots != per_node for _, slots in found):
        raise PlanError("launcher.hostfile", f"{path} lists {[f'{h} slots={s}' for h, s in found]} but the plan needs "
                        f"launcher.nodes={plan.nodes} hosts with slots={per_node} (dp x tp x pp = {plan.world_size} "
                        "ranks); fix the hostfile or launcher.nodes / launcher.gpus_per_node")
    return found


def command(run_dir: Path, launcher: MultinodeLauncherConfig, hostfile: Path) -> list[str]:
    """The deepspeed runner command line for this node (``no_ssh``) or for every host (ssh)."""
    cmd = [sys.executable, "-u", "-m", "deepspeed.launcher.runner", "--hostfile", str(hostfile),
           "--master_port", str(launcher.master_port or DEFAULT_PORT)]
    if launcher.master_addr:
        cmd += ["--master_addr", launcher.master_addr]
    if launcher.no_ssh:
        cmd += ["--no_ssh", "--node_rank", str(launcher.node_rank)]
    return cmd + ["--no_local_rank", "--module", "hybridtrain.worker", str(run_dir)]


FORWARDED_ENV = ("NCCL_", "TORCH_NCCL_", "TORCH_DISTRIBUTED_", "PYTORCH_ALLOC_CONF", "PYTORCH_CUDA_ALLOC_CONF",
                 "CUDA_DEVICE_MAX_CONNECTIONS", "UCX_", "FI_")
"""Prefixes of this shell's variables the ranks on every host get (the network and collective settings:
``NCCL_SOCKET_IFNAME``, ``NCCL_IB_HCA``, ``TORCH_NCCL_ASYNC_ERROR_HANDLING``, the allocator, libfabric's ``FI_*``).
DeepSpeed's runner passes on ``NCCL*`` only where its own accelerator is CUDA, and ``TORCH_NCCL_*`` never; pdsh
passes on nothing else (GPU review 3, finding 15; docs/slurm.md#network-settings-nccl-and-where-the-expert-groups-sit)."""


def forwarded_env(environ) -> dict[str, str]:
    """The variables of ``environ`` that :data:`FORWARDED_ENV` names, one line each in DeepSpeed's env file (a value
    holding a newline cannot be a line of it and is left out)."""
    return {k: v for k, v in environ.items() if k.startswith(FORWARDED_ENV) and "\n" not in v}


def launch(run_dir: Path, plan: Plan, launcher: MultinodeLauncherConfig, machine: Machine) -> int:
    """Start the runner for this node (or all hosts); return its exit code."""
    found = hosts(launcher, plan)
    hostfile = Path(launcher.hostfile).expanduser().resolve() if launcher.hostfile else RunDir(run_dir).hostfile
    if launcher.hostfile is None:
        hostfile.write_text("".join(f"{h} slots={s}\n" for h, s in found))
    threads = threads_per_rank(launcher, plan, machine)
    # CONTROLLER_ENV: the ranks on this host die with this process (hybridtrain.launch.parent.watch_controller),
    # the lifeline: those on the other hosts (hold_lifeline); it lives as long as this process
    lifeline = Lifeline(toward=found[0][0])
    extra = {**forwarded_env(os.environ), "HYBRIDTRAIN_THREADS": str(threads), "OMP_NUM_THREADS": str(threads),
             "HYBRIDTRAIN_NODES": ",".join(h for h, _ in found), **controller_env(), **lifeline.env(),
             **cpu_ranks_env(uses_gpus(launcher, machine))}  # CPU processes: the worker hides the GPUs (hide_gpus)
    # pdsh passes on only a few variables (PYTHON*, NCCL*...) plus the lines of DeepSpeed's env file
    env_file = RunDir(run_dir).deepspeed_env
    env_file.write_text("".join(f"{k}={v}\n" for k, v in extra.items()))
    env = dict(os.environ, PYTHONUNBUFFERED="1", DS_ENV_FILE=str(env_file), **extra)
    cmd = command(run_dir, launcher, hostfile)
    where = f"node {launcher.node_rank} of {plan.nodes}" if launcher.no_ssh else f"{plan.nodes} hosts over ssh"
    print(f"[hybridtrain] launching {plan.world_size} rank(s) on {where}, {threads} thread(s) each: "
          f"{' '.join(cmd)}", flush=True)
    return run_runner(cmd, env, run_dir, launcher.verbose)


def run_runner(cmd: list[str], env: dict, run_dir: Path, verbose: bool = True) -> int:
    """Run the deepspeed runner ``cmd`` (``launcher=multinode``) in its own session, forwarding Ctrl-C
    and SIGTERM (:func:`forwarder`); return its exit code as :func:`report_stop` reads it. Its
    stdout, which the ranks share, goes through :class:`~hybridtrain.launch.output.Output`."""
    out = Output(run_dir, verbose, cmd)
    try:  # the runner dies with the controller (its ranks watch the controller themselves)
        proc = subprocess.Popen(cmd, env=env, start_new_session=True, stdout=out.stdout, preexec_fn=parent_death())
    finally:
        out.started()
    old = {s: signal.signal(s, forwarder(proc)) for s in (signal.SIGINT, signal.SIGTERM)}
    try:
        code = proc.wait()
    finally:
        for s, h in old.items():
            signal.signal(s, h)
        out.finish()
    return report_stop(run_dir, code)


def forwarder(proc: subprocess.Popen):
    """A signal handler for the controller of a runner job: Ctrl-C ends the runner and its ranks at
    once; SIGTERM goes to the ranks only, which checkpoint and exit (:mod:`hybridtrain.train.preempt`).

    DeepSpeed's per-node launcher answers SIGTERM by terminating its ranks and killing them 30 s
    later, too soon for a large checkpoint; so it is left out, and exits by itself once its ranks
    have exited cleanly.
    """
    def forward(signum, _frame):
        workers = worker_processes(proc.pid) if signum == signal.SIGTERM else []
        if not workers:  # Ctrl-C, or the ranks are not started yet
            os.killpg(proc.pid, signum)
        for p in workers:
            p.send_signal(signum)

    return forward


def worker_processes(pid: int) -> list:
    """The ``hybridtrain.worker`` processes under process ``pid`` (psutil, a DeepSpeed dependency)."""
    import psutil

    try:
        children = psutil.Process(pid).children(recursive=True)
    except psutil.NoSuchProcess:
        return []
    out = []
    for p in children:
        try:
            if "hybridtrain.worker" in p.cmdline():
                out.append(p)
        except psutil.Error:
            pass
    return out
