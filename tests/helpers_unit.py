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

LLAMA_70B = ["+recipe=llama_7b", "model.config.num_hidden_layers=80", "model.config.hidden_size=8192",
             "model.config.intermediate_size=28672", "model.config.num_attention_heads=64",
             "model.config.num_key_value_heads=8"]
"""A Llama-2-70B shape on top of the ``llama_7b`` recipe (80 layers, GQA 64/8 heads)."""


def compose_raw(overrides: list[str]):
    """The ``DictConfig`` Hydra composes from ``conf/`` with ``overrides`` (as the CLI would)."""
    from hydra import compose, initialize_config_dir

    register_schema()
    with initialize_config_dir(config_dir=str(CONF_DIR), version_base="1.3"):
        return compose("config", overrides=overrides)


def compose_config(*overrides: str) -> Config:
    """The typed :class:`Config` of ``overrides`` (e.g. ``"+recipe=gpt_tiny"``)."""
    return to_config(compose_raw(list(overrides)))


class CliRun:
    """``python -m hybridtrain ARGS`` started in the background; :meth:`result` waits for it.

    The CLI tests start all their runs at once (each spends seconds importing torch and
    transformers), and read stdout and stderr from files so a full pipe never blocks a run.
    """

    def __init__(self, args: list[str], cwd: Path, cache_dir: Path):
        cwd.mkdir(parents=True, exist_ok=True)
        # PYTHONPATH: run this checkout's package, not whichever one is pip-installed (cwd is elsewhere)
        path = os.pathsep.join(p for p in (str(ROOT), os.environ.get("PYTHONPATH", "")) if p)
        env = dict(os.environ, HYBRIDTRAIN_CACHE=str(cache_dir), PYTHONUNBUFFERED="1", PYTHONPATH=path)
        self.args = args
        self._out, self._err = cwd / "stdout.txt", cwd / "stderr.txt"
        with open(self._out, "w") as out, open(self._err, "w") as err:
            self._proc = subprocess.Popen([sys.executable, "-m", "hybridtrain", *args], cwd=cwd, env=env,
                                          stdout=out, stderr=err, text=True)
        self._done: subprocess.CompletedProcess | None = None

    def result(self, timeout: float = 180) -> subprocess.CompletedProcess:
        """The finished run (``returncode``, ``stdout``, ``stderr``); kills it after ``timeout`` seconds."""
        if self._done is None:
            try:
                self._proc.wait(timeout=timeout)
            except subprocess.TimeoutExpired:
                self._proc.kill()
                self._proc.wait()
                raise
            self._done = subprocess.CompletedProcess(self.args, self._proc.returncode,
                                                     self._out.read_text(), self._err.read_text())
        return self._done

    def kill(self) -> None:
        """End the run if it is still going (fixture teardown)."""
        if self._proc.poll() is None:
            self._proc.kill()
            self._proc.wait()
