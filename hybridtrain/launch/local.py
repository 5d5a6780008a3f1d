"""The local launcher: DeepSpeed's per-node launcher on this machine, one process per rank."""
from __future__ import annotations

import os
import signal
import socket
import subprocess
import sys
import threading
from pathlib import Path

from hybridtrain.config.schema import LauncherConfig
from hybridtrain.launch.output import LOG_NAME, pump
from hybridtrain.plan.types import Machine, Plan


def free_port() -> int:
    """A TCP port free on this machine right now."""
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def threads_per_rank(launcher: LauncherConfig, plan: Plan, machine: Machine) -> int:
    """CPU threads for each worker so the ranks of this node do not oversubscribe its cores."""
    if launcher.threads_per_rank:
        return launcher.threads_per_rank
    local_ranks = plan.world_size // plan.nodes
    return max(1, machine.cpu_cores // local_ranks)


def command(run_dir: Path, plan: Plan, port: int) -> list[str]:
    """DeepSpeed's per-node launcher for every rank of this node, started directly.

    It is the command the deepspeed runner (``deepspeed.launcher.runner --num_gpus N``) builds and
    starts for a single node, less the runner's own Python process, which imports torch and
    deepspeed (about 1.3 s) only to write this line: the same world info (``localhost``: devices
    ``0 .. N-1``), address, port and flags, so the ranks get the same environment
    (``RANK``, ``LOCAL_RANK``, ``WORLD_SIZE``, ``MASTER_ADDR``/``PORT``, ``CUDA_VISIBLE_DEVICES``).
    """
    import base64
    import json

    world = json.dumps({"localhost": list(range(plan.world_size))}).encode()
    return [sys.executable, "-u", "-m", "deepspeed.launcher.launch",
            f"--world_info={base64.urlsafe_b64encode(world).decode()}", "--master_addr=127.0.0.1",
            f"--master_port={port}", "--module", "--no_local_rank", "--log_level=info",
            "hybridtrain.worker", str(run_dir)]


def launch(run_dir: Path, plan: Plan, launcher: LauncherConfig, machine: Machine) -> int:
    """Start ``plan.world_size`` workers through DeepSpeed's launcher; return the job's exit code.

    Workers find everything in ``run_dir`` (``config.yaml``, ``plan.json``, ``data.json``). The
    launcher kills every rank when one fails, so a dead rank ends the job with a non-zero code.
    """
    if launcher.nodes != 1:
        raise SystemExit(f"launcher.nodes={launcher.nodes}: the local launcher runs on one machine; "
                         "use launcher.nodes=1")
    port = launcher.master_port or free_port()
    threads = threads_per_rank(launcher, plan, machine)
    env = dict(os.environ, HYBRIDTRAIN_THREADS=str(threads), OMP_NUM_THREADS=str(threads),
               PYTHONUNBUFFERED="1")
    cmd = command(run_dir, plan, port)
    where = " ".join(cmd) if launcher.verbose else f"DeepSpeed's output in {run_dir / LOG_NAME}"
    print(f"[hybridtrain] launching {plan.world_size} rank(s), {threads} thread(s) each: {where}", flush=True)
    return run_runner(cmd, env, run_dir, launcher.verbose)


def run_runner(cmd: list[str], env: dict, run_dir: Path, verbose: bool = True) -> int:
    """Run the deepspeed launcher (or runner) ``cmd`` in its own session, forwarding Ctrl-C and
    SIGTERM (:func:`forwarder`); return its exit code as :func:`report_stop` reads it.

    Not ``verbose``: its stdout, which the ranks share, goes through :func:`~hybridtrain.launch.output.pump`
    (everything into ``RUN_DIR/launcher.log``, all but DeepSpeed's INFO/WARNING lines to the console);
    stderr stays the console's.
    """
    log = None if verbose else open(run_dir / LOG_NAME, "ab")
    if log is not None:
        log.write(f"$ {' '.join(cmd)}\n".encode())
        log.flush()
    proc = subprocess.Popen(cmd, env=env, start_new_session=True, stdout=None if verbose else subprocess.PIPE)
    reader = None
    if log is not None:
        console = getattr(sys.stdout, "buffer", sys.stdout)
        reader = threading.Thread(target=pump, args=(proc.stdout, console, log), daemon=True)
        reader.start()
    old = {s: signal.signal(s, forwarder(proc)) for s in (signal.SIGINT, signal.SIGTERM)}
    try:
        code = proc.wait()
    finally:
        for s, h in old.items():
            signal.signal(s, h)
        if reader is not None:  # the pipe ends when the last rank exits; a straggler holding it is not waited for
            reader.join(timeout=5)
            if not reader.is_alive():
                log.close()
    return report_stop(run_dir, code)


def forwarder(proc: subprocess.Popen):
    """A signal handler for the controller: Ctrl-C ends the runner and its ranks at once; SIGTERM goes
    to the ranks only, which checkpoint and exit (:mod:`hybridtrain.train.preempt`).

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


def report_stop(run_dir: Path, code: int) -> int:
    """After the ranks exited: if they stopped on a signal with a checkpoint, say so and return 0."""
    from hybridtrain.train.preempt import take_marker

    stopped = take_marker(run_dir)
    if stopped is None:
        return code
    print(f"[hybridtrain] stopped early after step {stopped['step']} with checkpoint {stopped['checkpoint']}; "
          f"continue with trainer.resume=auto hydra.run.dir={run_dir}", flush=True)
    return 0
