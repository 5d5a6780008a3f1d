"""Stopping early on a signal: SLURM's time-limit warning (SIGUSR1) or SIGTERM.

The signal may reach the ranks at different moments (or only some of them), but every rank must
stop after the same step, or the ones still training would wait forever in the next collective.
So the handler only sets a flag, and at the end of every step all ranks all-reduce it (MAX): one
scalar collective per step. Once it is set anywhere, every rank saves the same checkpoint and
leaves the loop; rank 0 then writes ``RUN_DIR/stopped.json``, which tells the launcher (the local
controller, or the SLURM job script that requeues itself) that the stop was orderly.
"""
from __future__ import annotations

import json
import os
import signal
from pathlib import Path
from typing import Optional

from hybridtrain.rundir import RunDir

STOP_SIGNALS = (signal.SIGTERM, signal.SIGUSR1)


class StopRequest:
    """A flag set by :data:`STOP_SIGNALS`, agreed on by every rank at step boundaries."""

    def __init__(self) -> None:
        self.signal_name: Optional[str] = None
        """The first stop signal this process received, if any."""
        self.stopped_at: Optional[int] = None
        """The step after which the loop stopped because of a signal (on every rank)."""

    def install(self) -> "StopRequest":
        """Handle SIGTERM and SIGUSR1 in this process from now on."""
        for sig in STOP_SIGNALS:
            signal.signal(sig, self._handler)
        return self

    def _handler(self, signum, _frame) -> None:
        if self.signal_name is None:
            self.signal_name = signal.Signals(signum).name
            # os.write, not print: a handler that prints while the main thread is printing raises
            # "reentrant call" inside the buffered stream
            # The launcher also sends SIGTERM to the survivors when a rank has died: they
            # never reach the step's end, so the message must not promise a checkpoint outright.
            os.write(2, f"[hybridtrain] {self.signal_name} received: every rank stops after this step "
                        "and saves a checkpoint (unless the job is being torn down because a rank "
                        "failed: then see that rank's error above)\n".encode())

    def agreed(self, device) -> bool:
        """Whether any rank has been signalled; a collective every rank must call at the same step."""
        import torch

        from hybridtrain.parallel import collectives

        flag = torch.tensor([1.0 if self.signal_name else 0.0], device=device)
        return bool(collectives.all_reduce(flag, device, op="max").item() > 0)


def write_marker(run_dir: Path, step: int, checkpoint: Path) -> None:
    """Rank 0, after the stop checkpoint: ``RUN_DIR/stopped.json`` for the launcher."""
    RunDir(run_dir).stop_marker.write_text(json.dumps({"step": step, "checkpoint": str(checkpoint)}))


def take_marker(run_dir: Path) -> Optional[dict]:
    """Read and remove ``RUN_DIR/stopped.json``; ``None`` when the run was not stopped by a signal."""
    path = RunDir(run_dir).stop_marker
    if not path.is_file():
        return None
    info = json.loads(path.read_text())
    path.unlink()
    return info
