"""The ranks of one machine, started and watched by the controller itself.

This is what DeepSpeed's per-node launcher (``deepspeed.launcher.launch``, which the deepspeed runner
starts on each node) does, written here because that launcher is a Python process of its own that
imports torch and deepspeed (a sizeable share of the time from the command to the first step,
``docs/benchmarks.md``) to set a few variables, start the ranks and wait, while the controller is
already running:

- every rank gets the launcher's variables (:func:`rank_env`; ``tests/unit/test_launch_output.py``
  compares them with what the launcher sets);
- a rank that exits non-zero ends the job: every rank's process tree gets SIGTERM, and SIGKILL
  after :data:`GRACE_S` (the launcher's ``terminate_process_tree``); the job's code is that rank's;
- Ctrl-C (SIGINT) reaches every rank's process group at once; SIGTERM reaches every rank, which
  checkpoint and exit (:mod:`hybridtrain.train.preempt`) in their own time, where the launcher
  would kill them 30 s later;
- a controller that dies (SIGKILL included) takes every rank with it (:mod:`hybridtrain.launch.parent`).

CPU ranks are forked from one process that imported their libraries once (:meth:`Ranks.fork`,
:mod:`hybridtrain.launch.preload`); GPU ranks are each a new interpreter (:meth:`Ranks.start`).
Several machines still go through the deepspeed runner (:mod:`hybridtrain.launch.multinode`).
"""
from __future__ import annotations

import os
import signal
import subprocess
import sys
import threading
import time
from pathlib import Path
from typing import TYPE_CHECKING, Callable, Mapping, Optional, Sequence

if TYPE_CHECKING:
    from hybridtrain.launch.preload import Preloader

GRACE_S = 30.0
"""Seconds the other ranks get to exit after SIGTERM when one has failed (DeepSpeed's launcher's)."""


def rank_env(base: Mapping[str, str], rank: int, world: int, port: int, devices: Sequence[int | str]) -> dict[str, str]:
    """The environment of local rank ``rank`` of a one-node job: ``base`` plus the ``env://``
    rendezvous and what DeepSpeed reads (``LOCAL_SIZE``, ``CROSS_*``, the visible devices)."""
    return {**base, "RANK": str(rank), "LOCAL_RANK": str(rank), "WORLD_SIZE": str(world),
            "LOCAL_SIZE": str(world), "CROSS_RANK": "0", "CROSS_SIZE": "1", "MASTER_ADDR": "127.0.0.1",
            "MASTER_PORT": str(port), "CUDA_VISIBLE_DEVICES": ",".join(str(d) for d in devices)}


def rank_of(process) -> Optional[int]:
    """The rank a ``psutil.Process`` of a local job runs, or None when it is no rank (the controller,
    the preload process, a launcher): a forked CPU rank by its name
    (:func:`hybridtrain.launch.preload.rank_name`), a rank started as its own interpreter by its command
    line and ``RANK``. Raises ``psutil.Error`` for a process that is gone."""
    name = process.name()
    if name.startswith("hybridtrain-r") and name[len("hybridtrain-r"):].isdigit():
        return int(name[len("hybridtrain-r"):])
    if "hybridtrain.worker" in " ".join(process.cmdline()):
        rank = process.environ().get("RANK")  # the deepspeed runner and launcher name the worker too, without RANK
        return int(rank) if rank is not None else None
    return None


def _in_rank(die_with_controller: Callable[[], None]) -> Callable[[], None]:
    """What each rank started as its own interpreter runs between fork and exec: it dies with the
    controller (:func:`hybridtrain.launch.parent.parent_death`), and SIGINT gets its default action. A
    shell starts a background job (``cmd &``, ``nohup``, many CI runners) with SIGINT ignored, children
    inherit that, and Python then installs no KeyboardInterrupt handler: the Ctrl-C the controller
    forwards (:meth:`Ranks.forward`) would be lost."""
    def preexec() -> None:
        die_with_controller()
        signal.signal(signal.SIGINT, signal.SIG_DFL)

    return preexec


class Forked:
    """A rank forked by the preload process (:mod:`hybridtrain.launch.preload`), which is its parent
    and reports its exit code: what :class:`Ranks` uses of a ``Popen`` (``pid``, ``poll``,
    ``send_signal``, ``wait``)."""

    def __init__(self, pid: int, codes: dict[int, int]):
        self.pid, self._codes = pid, codes

    def poll(self) -> Optional[int]:
        """The exit code once the preload process reported it (``-N``: killed by signal N)."""
        return self._codes.get(self.pid)

    def send_signal(self, signum: int) -> None:
        if self.poll() is None:
            os.kill(self.pid, signum)

    def wait(self) -> int:
        while self.poll() is None:
            time.sleep(0.05)
        return self.poll()


class Ranks:
    """The worker processes of this machine, each in its own session (the terminal's Ctrl-C reaches
    only the controller, which forwards it)."""

    def __init__(self) -> None:
        self.procs: list[subprocess.Popen | Forked] = []
        self.preload: Optional[Preloader] = None
        self.failed: Optional[int] = None
        """The job's exit code when the ranks could not all be started (:meth:`fork`)."""

    def start(self, cmd: list[str], envs: Sequence[dict], stdout=None) -> None:
        """Start one process per environment (install :meth:`forward` as the signal handler first)."""
        from hybridtrain.launch.parent import parent_death

        preexec = _in_rank(parent_death())  # on this (the main) thread: the signal follows the forking thread
        try:
            for env in envs:
                self.procs.append(subprocess.Popen(cmd, env=env, stdout=stdout, start_new_session=True,
                                                   preexec_fn=preexec))
        except BaseException:
            self.terminate(grace=0)
            raise

    def fork(self, run_dir: Path, base: Mapping[str, str], envs: Sequence[dict], stdout, preloader: Preloader) -> None:
        """Start one process per environment, forked by ``preloader``, the process forked from the
        controller that imports what a rank needs once (:mod:`hybridtrain.launch.preload`; it takes
        the environment ``base`` and a session of its own); return once every rank exists. Install
        :meth:`forward` as the signal handler first: until then it ends the preload process."""
        self.preload, reports = preloader, preloader.start(run_dir, base, envs, stdout)
        try:
            codes: dict[int, int] = {}
            for _ in envs:
                line = reports.readline()
                if not line:  # it failed while importing (its traceback is above) or was stopped
                    code = self.preload.wait()
                    print(f"[hybridtrain] the process that starts the ranks (hybridtrain.launch.preload) exited "
                          f"with code {code} before starting them all", file=sys.stderr, flush=True)
                    self.failed = 128 - code if code < 0 else (code or 1)
                    break
                self.procs.append(Forked(int(line), codes))
        except BaseException:
            reports.close()
            self.terminate(grace=0)
            raise
        threading.Thread(target=_read_codes, args=(reports, codes, [p.pid for p in self.procs]),
                         name="hybridtrain-ranks", daemon=True).start()

    def forward(self, signum: int, _frame=None) -> None:
        """A signal handler: SIGINT to every rank's process group, SIGTERM to every rank (and to the
        preload process while it has not started them all)."""
        if self.preload is not None and not self.procs and self.preload.poll() is None:
            self.preload.send_signal(signum)
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
        if self.failed is not None:
            self.terminate()
            return self.failed
        while True:
            codes = [p.poll() for p in self.procs]
            failed = next((c for c in codes if c not in (None, 0)), None)
            if failed is not None:
                self.terminate()
                return 128 - failed if failed < 0 else failed
            if all(c == 0 for c in codes):
                if self.preload is not None:
                    self.preload.wait()
                return 0
            time.sleep(poll_s)

    def terminate(self, grace: float = GRACE_S) -> None:
        """SIGTERM to every rank's process tree, SIGKILL to what is left after ``grace`` seconds."""
        import psutil  # a DeepSpeed dependency

        tree = []
        if self.preload is not None and self.preload.poll() is None:  # its children are the ranks
            try:
                root = psutil.Process(self.preload.pid)
                tree += [root, *root.children(recursive=True)]
            except psutil.Error:
                pass
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
        if self.preload is not None:
            self.preload.wait()


def _read_codes(reports, codes: dict[int, int], pids: list[int]) -> None:
    """The preload process's ``PID CODE`` lines into ``codes``. If it ends without reporting a rank (it
    was killed), that rank is killed and counts as failed (code 1), so :meth:`Ranks.wait` ends the others."""
    with reports:
        for line in reports:
            pid, code = line.split()
            codes[int(pid)] = int(code)
    for pid in pids:
        if pid not in codes:
            try:
                os.killpg(pid, signal.SIGKILL)  # its own session: its process group is its pid
            except (ProcessLookupError, PermissionError):
                pass
            codes[pid] = 1
