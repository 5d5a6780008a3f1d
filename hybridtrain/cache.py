"""Where hybridtrain keeps what it computed once: one root for every cache.

``$HYBRIDTRAIN_CACHE``, else ``~/.cache/hybridtrain``::

    ROOT/
      data-<fingerprint>/   the tokenized data (hybridtrain.data.prepare); data.cache_dir moves these alone
      shapes/<key>.json     the planner's parameter shapes per model config (hybridtrain.models.shapes)
      calibration/*.json    the cost model's machine probes (hybridtrain.plan.calibrate)
      peak_tflops.json      the CPU's measured matmul peak, for MFU (hybridtrain.observe.peak)

The rule, as HF's ``HF_HOME`` and a call's ``cache_dir=`` have it: the variable moves every cache, and
``data.cache_dir`` (a config key, so one run's choice) moves only the tokenized data, the one cache that
grows with the inputs and belongs on a large or local disk. The other entries are small and keyed by
the machine or the model config; they stay shared between runs, so a run with its own data cache
neither rebuilds the shapes nor re-measures the machine. Every cache goes through :class:`CacheDir`.
"""
from __future__ import annotations

import os
from dataclasses import dataclass
from pathlib import Path
from typing import Mapping, Optional

ENV = "HYBRIDTRAIN_CACHE"
"""The variable naming the cache root."""


@dataclass(frozen=True)
class CacheDir:
    """The caches under ``root`` (nothing is created until a cache writes)."""

    root: Path

    @classmethod
    def from_env(cls, environ: Optional[Mapping[str, str]] = None) -> "CacheDir":
        """The root ``$HYBRIDTRAIN_CACHE`` names (``~`` expanded), else ``~/.cache/hybridtrain``."""
        environ = os.environ if environ is None else environ
        root = environ.get(ENV) or os.path.join("~", ".cache", "hybridtrain")
        return cls(Path(root).expanduser())

    def data(self, cache_dir: Optional[str] = None) -> Path:
        """The folder of the tokenized data: ``data.cache_dir`` when set, else the root."""
        return Path(cache_dir).expanduser() if cache_dir else self.root

    @property
    def shapes(self) -> Path:
        """``shapes/``: the planner's block shapes per model config."""
        return self.root / "shapes"

    @property
    def calibration(self) -> Path:
        """``calibration/``: the cost model's matmul, block and all-reduce probes per host and device."""
        return self.root / "calibration"

    @property
    def peak_file(self) -> Path:
        """``peak_tflops.json``: the CPU matmul probe the MFU divides by."""
        return self.root / "peak_tflops.json"
