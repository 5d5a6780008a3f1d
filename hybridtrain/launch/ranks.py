"""The ranks of one machine, started and watched by the controller itself.

This is what DeepSpeed's per-node launcher (``deepspeed.launcher.launch``, which the deepspeed runner
starts on each node) does, written here because that launcher is a Python process of its own that
imports torch and deepspeed (1.2 s of CPU, about 15% of the time from the command to the first
step) to set a few variables, start the ranks and wait, while the controller is already running:

- every rank gets the launcher's variables (:func:`rank_env`; ``tests/unit/test_launch_output.py``
  compares them with what the launcher sets);
- a rank that exits non-zero ends the job: every rank's process tree gets SIGTERM, and SIGKILL
  after :data:`GRACE_S` (the launcher's ``terminate_process_tree``); the job's code is that rank's;
- Ctrl-C (SIGINT) reaches every rank's process group at once; SIGTERM reaches every rank, which
  checkpoint and exit (:mod:`hybridtrain.train.preempt`) in their own time, where the launcher
  would kill them 30 s later.

Several machines still go through the deepspeed runner (:mod:`hybridtrain.launch.multinode`).
"""
from __future__ import annotations

import os
import signal
import subprocess
import time
from typing import Mapping, Sequence

GRACE_S = 30.0
"""Seconds the other ranks get to exit after SIGTERM when one has failed (DeepSpeed's launcher's)."""


def rank_env(base: Mapping[str, str], rank: int, world: int, port: int, devices: Sequence[int | str]) -> dict[str, str]:
    """The environment of local rank ``rank`` of a one-node job: ``base`` plus the ``env://``
    rendezvous and what DeepSpeed reads (``LOCAL_SIZE``, ``CROSS_*``, the visible devices)."""
    return {**base, "RANK": str(rank), "LOCAL_RANK": str(rank), "WORLD_SIZE": str(world),
            "LOCAL_SIZE": str(world), "CROSS_RANK": "0", "CROSS_SIZE": "1", "MASTER_ADDR": "127.0.0.1",
            "MASTER_PORT": str(port), "CUDA_VISIBLE_DEVICES": ",".join(str(d) for d in devices)}


def _default_sigint() -> None:
    """In each rank before it starts: SIGINT's default action. A shell starts a background job (``cmd &``,
    ``nohup``, many CI runners) with SIGINT ignored, children inherit that, and Python then installs no
    KeyboardInterrupt handler: the Ctrl-C the controller forwards (:meth:`Ranks.forward`) would be lost."""
    signal.signal(signal.SIGINT, signal.SIG_DFL)


class Ranks:
    """The worker processes of this machine, each in its own session (the terminal's Ctrl-C reaches
    only the controller, which forwards it)."""

    def __init__(self) -> None:
        self.procs: list[subprocess.Popen] = []

    def start(self, cmd: list[str], envs: Sequence[dict], stdout=None) -> None:
        """Start one process per environment (install :meth:`forward` as the signal handler first)."""
        try:
            for env in envs:
                self.procs.append(subprocess.Popen(cmd, env=env, stdout=stdout, start_new_session=True,
                                                   preexec_fn=_default_sigint))
        except BaseException:
            self.terminate(grace=0)
            raise

    def forward(self, signum: int, _frame=None) -> None:
        """A signal handler: SIGINT to every rank's process group, SIGTERM to every rank."""
        for p in self.procs:
            if p.poll() is not None:
                continue
            try:
                if signum == signal.SIGINT:
                    os.killpg(p.pid, signum)
                else:
                    p.send_signal(signum)
            except ProcessLookupError:
                pass

    def wait(self, poll_s: float = 0.1) -> int:
        """Wait until every rank exited cleanly (0), or one failed: then end the others and return its
        code (``128 + N`` for a rank killed by signal N, as a shell reports it)."""
        while True:
            codes = [p.poll() for p in self.procs]
            failed = next((c for c in codes if c not in (None, 0)), None)
            if failed is not None:
                self.terminate()
                return 128 - failed if failed < 0 else failed
            if all(c == 0 for c in codes):
                return 0
            time.sleep(poll_s)

    def terminate(self, grace: float = GRACE_S) -> None:
        """SIGTERM to every rank's process tree, SIGKILL to what is left after ``grace`` seconds."""
        import psutil  # a DeepSpeed dependency

        tree = []
        for p in self.procs:
            if p.poll() is not None:  # reaped: its pid may already name another process
                continue
            try:
                root = psutil.Process(p.pid)
                tree += [root, *root.children(recursive=True)]
            except psutil.Error:
                pass
        for p in tree:
            try:
                p.terminate()
            except psutil.Error:
                pass
        _, alive = psutil.wait_procs(tree, timeout=grace)
        for p in alive:
            try:
                p.kill()
            except psutil.Error:
                pass
        for p in self.procs:
            p.wait()
