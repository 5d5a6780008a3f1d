"""What the launcher and the workers print: DeepSpeed's chatter to ``RUN_DIR/launcher.log``, the rest
to the console (``launcher.verbose=false``, the default).

The deepspeed launcher and the ranks share one stdout, which the controller reads line by line
(:func:`pump`): every line goes to the log file; the console gets all but DeepSpeed's INFO and
WARNING log lines (its logger writes ``[date] [LEVEL] [file:line:func] message`` to stdout) and its
start-up prints (:data:`DEEPSPEED_PRINTS`). DeepSpeed's ERROR lines, hybridtrain's lines, anything
unrecognised, and all of stderr (tracebacks, warnings, the progress bar, stack dumps), which
is never piped, reach the console as before. DeepSpeed has no switch for this: its launcher's
``--log_level`` applies only to the launcher process, and the ranks' logger is set up when
``deepspeed`` is imported.
"""
from __future__ import annotations

import re
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
