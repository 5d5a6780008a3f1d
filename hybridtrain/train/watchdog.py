"""Hang watchdog: a rank that finishes no training step for ``trainer.hang_timeout_s`` prints
the Python stack of every thread and exits non-zero, which ends the job.

A rank can stop progressing without dying and without sitting in a collective (a stuck file
system, a dead data worker, a deadlock in user code); ``launcher.timeout_minutes`` only bounds
waits inside collectives. The watchdog covers the rest. Every rank runs its own: when one
rank stalls, its peers soon block waiting for it, make no progress either and fire about the
same time, so every rank's stack reaches the log. Each waits ``GRACE_S`` after its dump before
exiting so the peers' dumps are written before the launcher's clean-up kills them.

The dump is :func:`faulthandler.dump_traceback` (it reads the frames without the GIL, so it
works while the main thread sits in a C call); the timing runs on a daemon thread. A
``faulthandler.dump_traceback_later`` backstop, re-armed with each beat, still dumps and exits
if some C extension holds the GIL so long that the watchdog thread cannot run.
"""
from __future__ import annotations

import faulthandler
import os
import sys
import threading
import time
from typing import Optional

HANG_EXIT_CODE = 3
"""Exit code of a rank the watchdog ends (the controller reports the runner's non-zero code)."""
GRACE_S = 5.0
"""Seconds between a rank's stack dump and its exit, so the stalled peers can dump theirs too."""


class Watchdog:
    """Ends the process when :meth:`beat` has not been called for ``timeout_s`` seconds.

    ``timeout_s=None`` (``trainer.hang_timeout_s: null``) makes every method a no-op. Call
    :meth:`start` before the training loop, :meth:`beat` after each step (and after anything long
    the loop does on purpose, such as a checkpoint save) and :meth:`stop` after the loop; or use
    it as a context manager. ``rank`` (for the messages) defaults to the ``torch.distributed`` rank.
    """

    def __init__(self, timeout_s: Optional[float], rank: Optional[int] = None):
        self.timeout_s = timeout_s
        self.rank = rank
        self._last = time.monotonic()
        self._stop = threading.Event()
        self._thread: Optional[threading.Thread] = None

    def start(self) -> "Watchdog":
        """Begin watching (no-op when ``timeout_s`` is ``None``); returns ``self``."""
        if self.timeout_s and self._thread is None:
            if self.rank is None:
                import torch.distributed as dist

                self.rank = dist.get_rank() if dist.is_available() and dist.is_initialized() else 0
            self._last = time.monotonic()
            self._arm_backstop()
            self._thread = threading.Thread(target=self._watch, name="hybridtrain-watchdog", daemon=True)
            self._thread.start()
        return self

    def stop(self) -> None:
        """Stop watching (the loop ended normally)."""
        if self._thread is not None:
            self._stop.set()
            faulthandler.cancel_dump_traceback_later()
            self._thread.join(timeout=1.0)
            self._thread = None

    def __enter__(self) -> "Watchdog":
        return self.start()

    def __exit__(self, *exc) -> None:
        self.stop()

    def beat(self) -> None:
        """Record progress: the next ``timeout_s`` seconds start now."""
        if self._thread is not None:
            self._last = time.monotonic()
            self._arm_backstop()

    def _arm_backstop(self) -> None:
        # Fires only if the Python watchdog thread could not (GIL held): dump and _exit(1).
        faulthandler.dump_traceback_later(self.timeout_s + GRACE_S + 60.0, exit=True)

    def _watch(self) -> None:
        while not self._stop.wait(min(1.0, self.timeout_s / 4)):
            idle = time.monotonic() - self._last
            if idle >= self.timeout_s:
                self._fire(idle)

    def _fire(self, idle: float) -> None:
        faulthandler.cancel_dump_traceback_later()
        print(f"[hybridtrain] rank {self.rank}: no training step finished for {idle:.0f}s "
              f"(trainer.hang_timeout_s={self.timeout_s:g}); stack of every thread of rank {self.rank}:",
              file=sys.stderr, flush=True)
        faulthandler.dump_traceback(file=sys.stderr, all_threads=True)
        print(f"[hybridtrain] rank {self.rank}: exiting with code {HANG_EXIT_CODE} (hang watchdog)",
              file=sys.stderr, flush=True)
        time.sleep(GRACE_S)
        os._exit(HANG_EXIT_CODE)
