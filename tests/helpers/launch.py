"""Run the real command line (``python -m hybridtrain``) from tests and read what it wrote.

Thin over :mod:`hybridtrain.cli` (starting) and :class:`hybridtrain.rundir.RunDir` (the run's files),
which the benchmarks and ``hybridtrain.verify`` use too; composing a config is :func:`helpers.config.compose`."""
from __future__ import annotations

import subprocess
from pathlib import Path

from hybridtrain import cli
from hybridtrain.cli import REPO  # noqa: F401  (re-exported for the tests)
from hybridtrain.rundir import RunDir


NO_REPORT = "trainer.report=false"
"""Added to a test's job unless it sets ``trainer.report`` itself: writing ``report.md`` and its plots at
the end of a run costs CPU time in every job, which adds up over CI (``docs/benchmarks.md``); the
report's tests ask for it."""


def run_cli(run_dir: Path, *overrides: str, timeout: float = 400, env: dict | None = None,
            check: bool = True) -> subprocess.CompletedProcess:
    """``python -m hybridtrain hydra.run.dir=RUN_DIR OVERRIDES...`` from the repository root, without the
    end-of-run report unless the overrides set ``trainer.report`` (:data:`NO_REPORT`); with ``check`` a
    non-zero exit fails the test showing the end of the output."""
    if not any(o.lstrip("+~").startswith("trainer.report=") for o in overrides):
        overrides = (*overrides, NO_REPORT)
    return cli.run(run_dir, overrides, timeout=timeout, env=env, cwd=REPO, check=check)


def metrics(run_dir: Path) -> list[dict]:
    """The records of ``RUN_DIR/metrics.jsonl``."""
    return RunDir(run_dir).metrics()


def losses(run_dir: Path) -> list[float]:
    """The training losses of ``RUN_DIR/metrics.jsonl``."""
    return RunDir(run_dir).losses()
