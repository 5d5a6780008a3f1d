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
  itself when it goes; DeepSpeed's launcher then exits as its ranks did.
- :class:`Lifeline`: ranks on other hosts (the ssh path of ``launcher=multinode``, where the controller's
  host may run no rank at all: a login node) hold a TCP connection to the controller, which only accepts
  and keeps it; the kernel closes it when the controller dies, however it dies, and a rank that reads the
  end of it kills itself (:func:`hold_lifeline`). pdsh, which outlives the runner, no longer matters.

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
LIFELINE_ENV = "HYBRIDTRAIN_LIFELINE"
"""``ADDRESS:PORT`` of the controller's :class:`Lifeline`, for the ranks on other hosts (:func:`hold_lifeline`)."""


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


class Lifeline:
    """The controller's end of the ranks' lifelines: a listening TCP socket whose accepted connections are kept
    open, never read or written, for as long as the controller lives (a daemon thread accepts them). The kernel
    closes them all when the process ends, by SIGKILL too, and every rank holding one then ends itself."""

    def __init__(self, toward: str):
        import threading

        self.address = _address_toward(toward)
        self._server = socket.create_server(("", 0), backlog=128)
        self.port = self._server.getsockname()[1]
        self._held: list[socket.socket] = []
        threading.Thread(target=self._accept, name="hybridtrain-lifeline", daemon=True).start()

    def _accept(self) -> None:
        while True:
            try:
                conn, _ = self._server.accept()
            except OSError:  # closed
                return
            self._held.append(conn)

    def env(self) -> dict[str, str]:
        """The variable telling the ranks where to connect."""
        return {LIFELINE_ENV: f"{self.address}:{self.port}"}


def _address_toward(host: str) -> str:
    """This host's address on the route to ``host`` (where the ranks run): what they can connect back to. A UDP
    socket's ``connect`` picks the route without sending anything; this host's name if there is none."""
    try:
        with socket.socket(socket.AF_INET, socket.SOCK_DGRAM) as probe:
            probe.connect((host, 9))
            return probe.getsockname()[0]
    except OSError:
        return socket.gethostname()


def hold_lifeline(value: str, signum: int = signal.SIGKILL, timeout: float = 30.0) -> bool:
    """In a rank: connect to the controller's :class:`Lifeline` at ``value`` (``ADDRESS:PORT``) and send ``signum``
    to this process as soon as the connection ends (the controller is gone). Returns whether it holds one; False
    (with a line saying so) when the controller cannot be reached, where the rank then ends at its next collective
    with the dead ranks instead."""
    import threading

    address, _, port = value.rpartition(":")
    try:
        conn = socket.create_connection((address, int(port)), timeout=timeout)
    except (OSError, ValueError) as err:
        print(f"[hybridtrain] cannot reach the controller at {value} ({err}); this rank will not notice it dying "
              "until its next collective", flush=True)
        return False
    conn.settimeout(None)

    def wait() -> None:
        try:
            while conn.recv(1):  # the controller never writes: only its end, or an error, returns
                pass
        except OSError:
            pass
        os.kill(os.getpid(), signum)

    threading.Thread(target=wait, name="hybridtrain-lifeline", daemon=True).start()
    return True
