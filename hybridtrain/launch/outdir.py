"""The output directory must be given, writable and not in use before anything else happens.

Hydra creates the run directory (``hydra.run.dir``, or ``hydra.sweep.dir`` for ``-m``) before it
calls hybridtrain, and fails there with a bare ``NotADirectoryError`` traceback when it cannot. A
Hydra callback (registered under ``hydra.callbacks`` in ``conf/config.yaml``) runs first: it refuses
an empty value (which would put the run into the current folder), creates the folder, writes a probe
file into it and takes the folder's lock (:mod:`hybridtrain.launch.lock`; refused while another run
holds it), each failure a config error naming the key (exit code 2) before Hydra writes ``.hydra/``,
before data preparation and before any worker starts. The lock is held until the run ends (this
process exits, its forked ranks with it).

Which lock file: ``RUN_DIR/.hybridtrain.lock``; under ``launcher=multinode launcher.no_ssh=true``
every node's controller runs the same command on the shared folder, so node ``K > 0`` takes
``.hybridtrain.lock.nodeK`` (its own slot) and node 0 the folder's. A sweep (``-m``) locks
``hydra.sweep.dir`` for the whole sweep and each job's folder while the job runs.
"""
from __future__ import annotations

import os
import sys
import tempfile
from pathlib import Path
from typing import Any

from hydra.experimental.callback import Callback
from omegaconf import OmegaConf

from hybridtrain.launch.lock import DirInUse, RunLock
from hybridtrain.rundir import RunDir


def check_given(path: str | os.PathLike | None, key: str) -> str | None:
    """``None`` when ``path`` names a folder, else the config error message: an empty value would make
    Hydra write the run into the current folder (``.`` says so explicitly)."""
    if path is None or not str(path).strip():
        return (f"{key}: an empty value would write the run into the current folder {Path.cwd()}; give a folder, "
                f"e.g. {key}=runs/my_run ({key}=. if the current folder is meant)")
    return None


def check_writable(path: str | os.PathLike, key: str) -> str | None:
    """Create ``path`` (with its parents) and write a probe file in it; return ``None`` when that
    works, else the config error message (naming ``key``)."""
    folder = Path(path).expanduser().absolute()
    try:
        folder.mkdir(parents=True, exist_ok=True)
        # Try a real write: permission bits do not stop root, read-only mounts and /proc still do.
        with tempfile.NamedTemporaryFile(dir=folder, prefix=".hybridtrain-write-probe-"):
            pass
    except OSError as err:
        blocker = next((p for p in [folder, *folder.parents] if p.exists()), None)
        why = (f"{blocker} is a file, not a folder" if blocker is not None and not blocker.is_dir()
               else f"{type(err).__name__}: {err.strerror or err}, writing under {blocker}")
        return (f"{key}: cannot write the output directory {folder} ({why}); "
                f"choose a writable folder, e.g. {key}=runs/my_run")
    return None


def check_checkpoints(run_dir: str | os.PathLike, key: str) -> str | None:
    """``None`` when a run in ``run_dir`` can write ``RUN_DIR/checkpoints`` (absent: the save makes it in the run
    folder, already probed), else the config error message: a regular file, a dangling link, or a folder
    (a link to other storage, a read-only mount) where a probe file cannot be written. Without this the first
    save found it after every step had trained (fault probe n63, n64)."""
    folder = RunDir(Path(run_dir).expanduser().absolute()).checkpoints
    if not folder.exists() and not folder.is_symlink():
        return None
    what = None
    if not folder.exists():
        what = f"a link to {os.readlink(folder)}, which does not exist"
    elif not folder.is_dir():
        what = "a file, not a folder"
    else:
        try:
            with tempfile.NamedTemporaryFile(dir=folder, prefix=".hybridtrain-write-probe-"):
                pass
        except OSError as err:
            what = f"not writable: {type(err).__name__}: {err.strerror or err}"
    if what is None:
        return None
    return (f"{key}: the run's checkpoint folder {folder} is {what}, so its saves would fail after the training; "
            f"move it away or make it writable, choose another {key}, or save nothing (trainer.save_final=false "
            "trainer.save_every=0)")


def saves(config: Any) -> bool:
    """Whether the composed run writes checkpoints (``trainer.save_every`` > 0 or ``trainer.save_final``)."""
    return bool((OmegaConf.select(config, "trainer.save_every") or 0) > 0
                or OmegaConf.select(config, "trainer.save_final", default=True))


def lock_node(config: Any) -> int:
    """The node whose lock slot this controller takes: ``launcher.node_rank`` under ``launcher=multinode``
    with ``launcher.no_ssh`` (every node runs the controller), else 0."""
    if OmegaConf.select(config, "launcher.name") == "multinode" and OmegaConf.select(config, "launcher.no_ssh"):
        return int(OmegaConf.select(config, "launcher.node_rank") or 0)
    return 0


class CheckOutputDir(Callback):
    """Hydra callback: a config error (exit code 2) when the run or sweep directory is empty, not
    writable or held by another run; otherwise it holds the folder's lock until the run ends."""

    def __init__(self) -> None:
        self._locks: dict[Path, RunLock] = {}
        """The run's or the sweep's folder: held until the run or sweep ends."""
        self._job_locks: dict[Path, RunLock] = {}
        """A sweep job's folder: held until the job ends."""

    def on_run_start(self, config: Any, **kwargs: Any) -> None:
        folder = self._check(config.hydra.run.dir, "hydra.run.dir")
        self._locks[folder] = self._take(folder, "hydra.run.dir", lock_node(config))
        self._check_saves(config, folder, "hydra.run.dir")

    def on_run_end(self, config: Any, **kwargs: Any) -> None:
        self._release_all()

    def on_multirun_start(self, config: Any, **kwargs: Any) -> None:
        folder = self._check(config.hydra.sweep.dir, "hydra.sweep.dir")
        self._locks[folder] = self._take(folder, "hydra.sweep.dir", 0)

    def on_multirun_end(self, config: Any, **kwargs: Any) -> None:
        self._release_all()

    def on_job_start(self, config: Any, **kwargs: Any) -> None:
        """A sweep's job: its own folder (a single run's is already held since :meth:`on_run_start`)."""
        folder = Path(config.hydra.runtime.output_dir).resolve()
        if folder not in self._locks:
            self._job_locks[folder] = self._take(folder, "hydra.sweep.dir", lock_node(config))
            self._check_saves(config, folder, "hydra.sweep.dir")

    def on_job_end(self, config: Any, job_return: Any = None, **kwargs: Any) -> None:
        lock = self._job_locks.pop(Path(config.hydra.runtime.output_dir).resolve(), None)
        if lock is not None:
            lock.release()

    @staticmethod
    def _check(path: str, key: str) -> Path:
        message = check_given(path, key) or check_writable(path, key)
        if message is not None:
            _refuse(message)
        return Path(path).expanduser().resolve()

    @staticmethod
    def _check_saves(config: Any, folder: Path, key: str) -> None:
        message = check_checkpoints(folder, key) if saves(config) else None
        if message is not None:
            _refuse(message)

    @staticmethod
    def _take(folder: Path, key: str, node: int) -> RunLock:
        try:
            lock = RunLock.acquire(RunDir(folder).node_lock_file(node))
        except DirInUse as err:
            _refuse(f"{key}: {folder} is {err}; wait {err.wait} or choose another folder, e.g. {key}=runs/my_run_2")
        if lock.warning:
            print(f"[hybridtrain] warning: {lock.warning}", file=sys.stderr, flush=True)
        return lock

    def _release_all(self) -> None:
        for lock in [*self._job_locks.values(), *self._locks.values()]:
            lock.release()
        self._locks.clear()
        self._job_locks.clear()


def _refuse(message: str) -> None:
    print(f"[hybridtrain] config error: {message}", file=sys.stderr, flush=True)
    sys.exit(2)
