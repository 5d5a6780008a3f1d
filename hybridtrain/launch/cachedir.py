"""The cache folders must be writable before the plan, the data or any rank touches them.

The planner writes its shapes under the cache root (:class:`hybridtrain.cache.CacheDir`), the
controller the tokenized data under ``data.cache_dir`` (else the root). On a cluster an unwritable or
over-quota ``HOME`` is common; without this probe it surfaced as a ``FileNotFoundError`` traceback from
deep inside the planner or :func:`hybridtrain.data.prepare.prepare`. The probe is the run directory's
(:func:`hybridtrain.launch.outdir.check_writable`): create the folder, write a file in it.
"""
from __future__ import annotations

import os
from pathlib import Path
from typing import Mapping, Optional

from hybridtrain.cache import ENV, CacheDir
from hybridtrain.launch.outdir import check_writable


def _why(message: str) -> str:
    """The reason in :func:`check_writable`'s message (what stands between its ``(`` and ``); choose``)."""
    _, _, rest = message.partition(" (")
    why, found, _ = rest.rpartition("); choose")
    return why if found else message


def check_caches(cache_dir: Optional[str], environ: Optional[Mapping[str, str]] = None) -> Optional[str]:
    """``None`` when the cache root and ``data.cache_dir`` (when set) can be written, else the config
    error message naming what chose the folder: ``data.cache_dir``, ``HYBRIDTRAIN_CACHE``, or ``HOME``
    for the default root ``~/.cache/hybridtrain``."""
    environ = os.environ if environ is None else environ
    if environ.get(ENV):
        root, key, what = CacheDir.from_env(environ).root, ENV, f"{ENV}={environ[ENV]}"
        remedy = f"set {ENV}=<a writable folder>"
    else:  # ~ from this environment's HOME (Path.expanduser reads the process's)
        home = environ.get("HOME") or os.path.expanduser("~")
        root, key, what = Path(home) / ".cache" / "hybridtrain", "HOME", f"HOME={home}: the default cache root"
        remedy = f"set {ENV}=<a writable folder> (it moves every cache; data.cache_dir moves the tokenized data only)"
    checks = [("data.cache_dir", CacheDir(root).data(cache_dir), "", "set data.cache_dir=<a writable folder>")
              ] if cache_dir else []
    checks.append((key, root, what, remedy))
    for name, folder, label, fix in checks:
        message = check_writable(folder, name)
        if message is not None:
            return f"{name}: cannot write the cache folder {folder.absolute()} ({label + '; ' if label else ''}{_why(message)}); {fix}"
    return None


def matplotlib_dir(environ: Optional[Mapping[str, str]] = None) -> Optional[Path]:
    """Where matplotlib (the report's plots) should keep its config and font cache when its own folder,
    ``$XDG_CONFIG_HOME`` or ``~/.config`` + ``/matplotlib``, cannot be written (the unwritable ``HOME`` of
    :func:`check_caches`, with ``HYBRIDTRAIN_CACHE`` set): ``ROOT/matplotlib``, so that the run says nothing
    about it (matplotlib warns over two lines); ``None`` when ``MPLCONFIGDIR`` is set or its folder works."""
    environ = os.environ if environ is None else environ
    if environ.get("MPLCONFIGDIR"):
        return None
    home = environ.get("HOME") or os.path.expanduser("~")
    own = Path(environ.get("XDG_CONFIG_HOME") or Path(home) / ".config") / "matplotlib"
    if check_writable(own, "MPLCONFIGDIR") is None:
        return None
    return CacheDir.from_env(environ).root / "matplotlib"
