"""The processes a run starts die with the controller that started them, even when it is SIGKILLed.

Without this a controller killed with ``kill -9`` (or by the OOM killer) left its ranks training
headless to the end, writing into a run directory nobody owned any more (:mod:`hybridtrain.launch.lock`).

- :func:`parent_death`: for a child forked (or ``Popen``-ed) by its supervisor, Linux's parent-death
  signal (``prctl(PR_SET_PDEATHSIG, SIGKILL)``), set in the child between fork and exec (it survives
  exec). The local launcher's ranks (:mod:`hybridtrain.launch.ranks`), the preload process and the ranks
  it forks (:mod:`hybridtrain.launch.preload`), the deepspeed runner of ``launcher=multinode``
  (:mod:`hybridtrain.launch.multinode`). Two traps: the kernel sends the signal when the *thread* that
  forked the child exits, not the process, so every fork here happens on the main thread; and a parent
  that died before ``prctl`` ran is not noticed by the kernel, so the child then checks ``getppid``.
- :func:`watch_controller`: the ranks the deepspeed runner starts are grandchildren of processes
  hybridtrain does not control (DeepSpeed's per-node launcher). Each such rank on the controller's host
  watches the controller itself (a pidfd, which becomes readable when the process exits) and kills
  itself when it goes; DeepSpeed's launcher then exits as its ranks did. Ranks on other hosts (the ssh
  path of ``launcher=multinode``) are out of reach: they fail at their next collective with the dead
  ranks (a closed connection; at the latest after ``launcher.timeout_minutes``), which ends them there;
  when the controller's host runs no rank at all, nothing ends them (pdsh outlives the runner).

SIGKILL, not SIGTERM: a SIGTERM makes a rank save a checkpoint (:mod:`hybridtrain.train.preempt`), which
needs every rank and, for a large model, minutes; a controller killed hard means the job is killed hard.
The newest complete checkpoint stays (checkpoints are written atomically) and ``trainer.resume=auto``
continues from it. SLURM's ranks are children of ``slurmstepd``, which SLURM ends with the job.
"""
from __future__ import annotations

import os
import signal
import socket
from typing import Callable

PR_SET_PDEATHSIG = 1
"""``prctl`` option: the signal this process gets when its parent (thread) exits (``<linux/prctl.h>``)."""
CONTROLLER_ENV = "HYBRIDTRAIN_CONTROLLER"
"""``PID@HOST`` of the controller, given to the ranks the deepspeed runner starts (:func:`watch_controller`)."""


def parent_death(signum: int = signal.SIGKILL) -> Callable[[], None]:
    """A function to call in a child right after it was forked by this process (``preexec_fn``, or first
    thing after ``os.fork``): the child gets ``signum`` when this process's forking thread exits, and
    sends it to itself at once if that already happened. Resolved here, in the parent: the child only
    makes one C call (no ``dlopen`` between fork and exec). A no-op where ``prctl`` does not exist."""
    parent = os.getpid()
    try:
        import ctypes

        prctl = ctypes.CDLL(None, use_errno=True).prctl
    except (OSError, AttributeError):  # not Linux
        return lambda: None

    def in_child() -> None:
        prctl(PR_SET_PDEATHSIG, signum, 0, 0, 0)
        if os.getppid() != parent:  # the parent died before prctl: the kernel will never tell
            os.kill(os.getpid(), signum)

    return in_child


def controller_env() -> dict[str, str]:
    """The variable that tells ranks started by another launcher which process to die with."""
    return {CONTROLLER_ENV: f"{os.getpid()}@{socket.gethostname()}"}


def watch_controller(value: str, signum: int = signal.SIGKILL) -> bool:
    """In a rank: when ``value`` (``PID@HOST``, :data:`CONTROLLER_ENV`) names a process on this host, send
    ``signum`` to this process as soon as that one exits (at once if it is gone already). Returns whether
    it watches; False on another host, or without pidfds (Linux before 5.3)."""
    import select
    import threading

    pid, _, host = value.partition("@")
    if not pid.isdigit() or host != socket.gethostname():
        return False
    try:
        fd = os.pidfd_open(int(pid))
    except ProcessLookupError:
        os.kill(os.getpid(), signum)
        return True
    except (OSError, AttributeError):
        return False

    def wait() -> None:
        select.select([fd], [], [])  # readable once the process has exited
        os.kill(os.getpid(), signum)

    threading.Thread(target=wait, name="hybridtrain-controller-watch", daemon=True).start()
    return True
