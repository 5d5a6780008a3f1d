"""What the ranks (and the deepspeed runner) print: DeepSpeed's chatter to ``RUN_DIR/launcher.log``,
the rest to the console (``launcher.verbose=false``, the default).

The processes the controller starts share one stdout, a pipe the controller reads line by line
(:class:`Output`, :func:`pump`): every line goes to the log file; the console gets all but
DeepSpeed's INFO and WARNING log lines (its logger writes ``[date] [LEVEL] [file:line:func] message``
to stdout) and its start-up prints (:data:`DEEPSPEED_PRINTS`). DeepSpeed's ERROR lines,
hybridtrain's lines, anything unrecognised, and all of stderr (tracebacks, warnings, the progress
bar, stack dumps), which is never piped, reach the console as before. DeepSpeed has no switch for
this: its launchers' ``--log_level`` applies only to their own process, and a rank's logger is set
up when ``deepspeed`` is imported.
"""
from __future__ import annotations

import os
import re
import sys
import threading
from pathlib import Path
from typing import BinaryIO

LOG_NAME = "launcher.log"
"""The file in the run directory that receives everything the launcher and the ranks print to stdout."""

DEEPSPEED_LOG = re.compile(rb"^(?:[\w.-]+: )?\[\d{4}-\d\d-\d\d \d\d:\d\d:\d\d,\d+\] \[(?:DEBUG|INFO|WARNING)\] ")
"""A DeepSpeed log line below ERROR, optionally after pdsh's ``host: `` prefix."""

DEEPSPEED_PRINTS = (b"SEED_LAYERS=", b"Using topology:")
"""Starts of the lines DeepSpeed's pipeline module prints with ``print`` on rank 0."""


def for_console(line: bytes) -> bool:
    """Whether a stdout line of the launcher or a rank is shown on the console when not verbose."""
    if DEEPSPEED_LOG.match(line):
        return False
    host, sep, rest = line.partition(b": ")
    body = rest if sep and re.fullmatch(rb"[\w.-]+", host) else line
    return not body.startswith(DEEPSPEED_PRINTS)


def pump(stream: BinaryIO, console: BinaryIO, log: BinaryIO) -> None:
    """Copy ``stream`` line by line into ``log`` and the lines :func:`for_console` keeps into
    ``console``, flushing each, until the stream ends (every writer has exited)."""
    for line in iter(stream.readline, b""):
        log.write(line)
        log.flush()
        if for_console(line):
            console.write(line)
            console.flush()


class Output:
    """The stdout to give the processes the controller starts: the console's own (``verbose``), or
    the write end of a pipe that :func:`pump` empties into ``RUN_DIR/launcher.log`` and the console."""

    def __init__(self, run_dir: Path, verbose: bool, command: list[str]):
        self.log = self._read = self.stdout = self._reader = None
        if verbose:
            return
        self.log = open(Path(run_dir) / LOG_NAME, "ab")
        self.log.write(f"$ {' '.join(command)}\n".encode())
        self.log.flush()
        self._read, self.stdout = os.pipe()

    def started(self) -> None:
        """The processes hold the pipe now: drop the controller's write end, start pumping."""
        if self.stdout is None:
            return
        os.close(self.stdout)
        console = getattr(sys.stdout, "buffer", sys.stdout)
        self._reader = threading.Thread(target=pump, args=(os.fdopen(self._read, "rb"), console, self.log), daemon=True)
        self._reader.start()

    def finish(self, timeout: float = 5.0) -> None:
        """After the processes exited: wait for the last lines (not for a straggler that still holds the pipe)."""
        if self._reader is None:
            return
        self._reader.join(timeout)
        if not self._reader.is_alive():
            self.log.close()
