"""Run the real command line (``python -m hybridtrain``) from tests and read what it wrote."""
from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]


def run_cli(run_dir: Path, *overrides: str, timeout: float = 400, env: dict | None = None,
            check: bool = True) -> subprocess.CompletedProcess:
    """``python -m hybridtrain hydra.run.dir=RUN_DIR OVERRIDES...``; with ``check`` a non-zero exit fails
    the test showing the end of the output."""
    cmd = [sys.executable, "-m", "hybridtrain", f"hydra.run.dir={run_dir}", *overrides]
    full_env = dict(os.environ, PYTHONUNBUFFERED="1", **(env or {}))
    proc = subprocess.run(cmd, cwd=REPO, env=full_env, capture_output=True, text=True, timeout=timeout)
    if check and proc.returncode != 0:
        raise AssertionError(f"{' '.join(cmd)} exited {proc.returncode}\n--- stdout\n{proc.stdout[-6000:]}"
                             f"\n--- stderr\n{proc.stderr[-6000:]}")
    return proc


def metrics(run_dir: Path) -> list[dict]:
    """The records of ``RUN_DIR/metrics.jsonl``."""
    return [json.loads(line) for line in (Path(run_dir) / "metrics.jsonl").read_text().splitlines()]


def losses(run_dir: Path) -> list[float]:
    return [m["loss"] for m in metrics(run_dir)]


def compose_config(overrides: list[str]):
    """The typed :class:`~hybridtrain.config.Config` Hydra composes for ``overrides`` (no launch)."""
    from hydra import compose, initialize_config_dir

    from hybridtrain.config import CONF_DIR, register_schema, to_config

    register_schema()
    with initialize_config_dir(config_dir=str(CONF_DIR), version_base="1.3"):
        return to_config(compose("config", overrides=overrides))
