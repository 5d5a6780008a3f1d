"""The GPU tier's per-test verdict log, for ``scripts/gpu_check.sh``.

With ``HYBRIDTRAIN_GPU_VERDICTS=FILE`` every test appends to FILE one JSON line when it starts and one per
verdict when it ends (flushed and synced at once), so a check stopped by its time limit still has the
verdict of every test that finished and names the one in flight; pytest's junitxml is written only at the
end. Under pytest-xdist only the controlling process writes (the workers' reports reach it)."""
from __future__ import annotations

import json
import os
import time
from pathlib import Path


class VerdictLog:
    """pytest plugin: ``{"test", "event": "start"}`` and ``{"test", "event": "verdict", "outcome", "when",
    "seconds", "reason"}`` lines (``outcome``: passed, failed, skipped; ``when``: setup, call, teardown)."""

    def __init__(self, path: Path) -> None:
        self.path = path
        self.path.parent.mkdir(parents=True, exist_ok=True)

    def _write(self, record: dict) -> None:
        with self.path.open("a") as f:
            f.write(json.dumps({**record, "time": round(time.time(), 3)}) + "\n")
            f.flush()
            os.fsync(f.fileno())

    def pytest_runtest_logstart(self, nodeid, location) -> None:
        self._write({"test": nodeid, "event": "start"})

    def pytest_runtest_logreport(self, report) -> None:
        if report.when != "call" and report.outcome == "passed":
            return  # a passing setup or teardown is no verdict
        reason = ""
        if report.skipped and isinstance(report.longrepr, tuple):
            reason = str(report.longrepr[2])
        elif report.failed:
            text = report.longreprtext.strip().splitlines()
            reason = next((ln for ln in reversed(text) if ln.startswith("E ")), text[-1] if text else "")[:300]
        self._write({"test": report.nodeid, "event": "verdict", "outcome": report.outcome, "when": report.when,
                     "seconds": round(report.duration, 2), "reason": reason})


def pytest_configure(config) -> None:
    path = os.environ.get("HYBRIDTRAIN_GPU_VERDICTS")
    if path and not hasattr(config, "workerinput"):  # the controller, or a run without xdist
        config.pluginmanager.register(VerdictLog(Path(path)), "hybridtrain-gpu-verdicts")
