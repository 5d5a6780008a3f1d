"""Helpers shared by the CPU unit tests (no worker processes, no deepspeed import).

Kept out of ``conftest.py`` on purpose: these are plain functions the unit-test modules import.
"""
from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

from hybridtrain.config import CONF_DIR, Config, register_schema, to_config

ROOT = Path(__file__).resolve().parents[1]
RECIPES = sorted(p.stem for p in (ROOT / "recipes").glob("*.yaml"))
"""Every shipped recipe; globbed so a new recipe is covered without editing the tests."""


def compose_raw(overrides: list[str]):
    """The ``DictConfig`` Hydra composes from ``conf/`` with ``overrides`` (as the CLI would)."""
    from hydra import compose, initialize_config_dir

    register_schema()
    with initialize_config_dir(config_dir=str(CONF_DIR), version_base="1.3"):
        return compose("config", overrides=overrides)


def compose_config(*overrides: str) -> Config:
    """The typed :class:`Config` of ``overrides`` (e.g. ``"+recipe=gpt_tiny"``)."""
    return to_config(compose_raw(list(overrides)))


def run_cli(args: list[str], cwd: Path, cache_dir: Path, timeout: float = 180) -> subprocess.CompletedProcess:
    """``python -m hybridtrain ARGS`` in a fresh process, tokens cached under ``cache_dir``."""
    env = dict(os.environ, HYBRIDTRAIN_CACHE=str(cache_dir), PYTHONUNBUFFERED="1")
    return subprocess.run([sys.executable, "-m", "hybridtrain", *args], cwd=cwd, env=env,
                          capture_output=True, text=True, timeout=timeout)
