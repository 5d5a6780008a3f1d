"""The output directory must be writable before anything else happens.

Hydra creates the run directory (``hydra.run.dir``, or ``hydra.sweep.dir`` for ``-m``) before it
calls hybridtrain, and fails there with a bare ``NotADirectoryError`` traceback when it cannot. A
Hydra callback (registered under ``hydra.callbacks`` in ``conf/config.yaml``) runs first: it
creates the folder and writes a probe file into it, and on failure prints a config error naming
the key and exits with code 2, before data preparation and before any worker starts.
"""
from __future__ import annotations

import os
import sys
import tempfile
from pathlib import Path
from typing import Any

from hydra.experimental.callback import Callback


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


class CheckOutputDir(Callback):
    """Hydra callback: a config error (exit code 2) when the run or sweep directory is not writable."""

    def on_run_start(self, config: Any, **kwargs: Any) -> None:
        self._check(config.hydra.run.dir, "hydra.run.dir")

    def on_multirun_start(self, config: Any, **kwargs: Any) -> None:
        self._check(config.hydra.sweep.dir, "hydra.sweep.dir")

    @staticmethod
    def _check(path: str, key: str) -> None:
        message = check_writable(path, key)
        if message is not None:
            print(f"[hybridtrain] config error: {message}", file=sys.stderr, flush=True)
            sys.exit(2)
