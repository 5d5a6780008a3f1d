"""A run owns its directory: the controller holds an ``flock`` on ``RUN_DIR/.hybridtrain.lock``.

Two commands given one ``hydra.run.dir`` would otherwise write the same ``config.yaml``, ``plan.json``,
``metrics.jsonl`` and checkpoints, each run's ranks reading the other's files. The Hydra callback of
:mod:`hybridtrain.launch.outdir` takes the lock before anything is written into the folder (Hydra's
``.hydra/`` included); the second command exits with code 2 naming the holder, whose pid, host, start
time and command the lock file holds.

- **Released on exit.** The kernel drops an ``flock`` when the last descriptor of its open file goes,
  so a controller that dies (even by SIGKILL) never leaves a stale lock: a lock file left behind is
  just a file, and the next run takes it (resuming into the same folder works). The file is never
  removed or replaced (a new inode would let a second run lock another file than the first holds).
- **Held until the ranks exited.** The controller holds it while it waits for its ranks; processes
  forked from it (the preload process and the CPU ranks forked from that) share the descriptor, so
  the lock lasts while any of them runs.
- **SLURM** (``launcher=slurm``): the job runs later on another node, after the controller exited. The
  controller writes the job id into the lock file after ``sbatch`` (:func:`record_job`); a later
  controller that gets the ``flock`` still refuses the folder while ``squeue`` lists that job (pending,
  running, requeued). Without ``squeue`` on PATH that check is skipped.
- **A file system without ``flock``** (some Lustre mounts, old NFS): a warning, and the run goes on
  unguarded rather than not at all.

Why by hand: ``fcntl.flock`` is the whole mechanism (a few lines). The ``filelock`` package (a transitive
dependency) wraps the same call, but writes no holder into the file for the refusal to name, and where
``flock`` is missing falls back to a marker file, which a killed holder leaves behind as a stale lock.
"""
from __future__ import annotations

import errno
import fcntl
import json
import os
import shutil
import socket
import subprocess
import sys
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Callable, Optional

UNSUPPORTED = {errno.ENOLCK, errno.EOPNOTSUPP, errno.ENOSYS, errno.EINVAL}
"""``flock`` errors that mean the file system offers no locks (not that another process holds one)."""
ALIVE_STATES = {"PENDING", "RUNNING", "CONFIGURING", "COMPLETING", "SUSPENDED", "REQUEUED", "REQUEUE_HOLD",
                "REQUEUE_FED", "RESIZING", "SIGNALING", "STAGE_OUT", "STOPPED", "PREEMPTED"}
"""``squeue`` states of a job that may still write into its run directory."""


class DirInUse(Exception):
    """The folder is held by another run; the message names the holder (``in use by ...``) and ``wait``
    what to wait for (``for it to end``, or for a SLURM job, ``scancel`` included)."""

    def __init__(self, message: str, wait: str = "for it to end"):
        super().__init__(message)
        self.wait = wait


def holder_record() -> dict:
    """What the lock file says about this process: pid, host, start time (UTC) and command."""
    return {"pid": os.getpid(), "host": socket.gethostname(),
            "started": time.strftime("%Y-%m-%d %H:%M:%S UTC", time.gmtime()),
            "command": " ".join(["python -m hybridtrain", *sys.argv[1:]])[:300]}


def describe(record: dict) -> str:
    """``pid N on host H since T: COMMAND`` (or what of it the record holds)."""
    if not record.get("pid"):
        return "a process that is just starting"
    text = f"pid {record['pid']} on host {record.get('host', '?')} since {record.get('started', '?')}"
    return text + (f": {record['command']}" if record.get("command") else "")


def read_record(path: Path) -> dict:
    """The holder record in lock file ``path`` (``{}`` when it is missing, empty or not JSON)."""
    try:
        data = json.loads(path.read_text() or "{}")
    except (OSError, ValueError):
        return {}
    return data if isinstance(data, dict) else {}


def slurm_job_state(job_id: str) -> Optional[str]:
    """The ``squeue`` state of SLURM job ``job_id``, or None when squeue is missing or no longer lists it."""
    squeue = shutil.which("squeue")
    if squeue is None:
        return None
    try:
        out = subprocess.run([squeue, "-h", "-j", str(job_id), "-o", "%T"], capture_output=True, text=True, timeout=30)
    except (OSError, subprocess.TimeoutExpired):
        return None
    state = out.stdout.split()[0] if out.returncode == 0 and out.stdout.split() else None
    return state


@dataclass
class RunLock:
    """An exclusive ``flock`` on one lock file, held until :meth:`release` or this process's exit.
    ``fd`` is None when the file system cannot lock (``warning`` says why)."""

    path: Path
    fd: Optional[int]
    warning: Optional[str] = None

    @classmethod
    def acquire(cls, path: Path, job_state: Callable[[str], Optional[str]] = slurm_job_state) -> "RunLock":
        """Take the lock of ``path`` (created if missing) and write this process's record into it; raise
        :class:`DirInUse` when another process holds it, or when the record names a SLURM job that
        ``job_state`` (``squeue``) still lists."""
        fd = os.open(path, os.O_RDWR | os.O_CREAT | os.O_CLOEXEC, 0o644)
        try:
            fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
        except BlockingIOError:
            os.close(fd)
            raise DirInUse(f"in use by another run ({describe(read_record(path))})") from None
        except OSError as err:
            os.close(fd)
            if err.errno in UNSUPPORTED:
                return cls(path, None, f"cannot lock {path} ({err.strerror}): this file system has no flock, "
                                       "so a second run in this folder is not refused")
            raise
        job = read_record(path).get("slurm_job")
        state = job_state(str(job)) if job else None
        if state in ALIVE_STATES:
            fcntl.flock(fd, fcntl.LOCK_UN)
            os.close(fd)
            raise DirInUse(f"in use by SLURM job {job} ({state})", wait=f"for job {job} to end (scancel {job} ends it)")
        lock = cls(path, fd)
        lock.write(holder_record())
        return lock

    def write(self, record: dict) -> None:
        """Replace the lock file's record, in place (a rename would give the file a new inode)."""
        if self.fd is None:
            return
        data = (json.dumps(record) + "\n").encode()
        os.ftruncate(self.fd, 0)
        os.pwrite(self.fd, data, 0)

    def release(self) -> None:
        """Drop the lock (the file and its record stay: the record names the last holder)."""
        if self.fd is not None:
            fcntl.flock(self.fd, fcntl.LOCK_UN)
            os.close(self.fd)
            self.fd = None


def record_job(path: Path, job_id: str) -> None:
    """Add SLURM job ``job_id`` to the record of lock file ``path`` (the controller holds the lock): later
    controllers refuse the folder while that job is queued or running (:meth:`RunLock.acquire`)."""
    record = {**read_record(path), "slurm_job": str(job_id)}
    try:
        with open(path, "r+") as f:  # in place: the same inode the lock is on
            f.truncate(0)
            f.write(json.dumps(record) + "\n")
    except OSError:
        pass  # no lock file (a file system without flock): nothing to record
