"""``hybridtrain.cli`` without starting anything: it composes what ``python -m hybridtrain`` composes,
and spells the command, the environment and a failure the way the tests, benchmarks and verify use
them (the runs themselves: ``tests/dist/test_cli_config.py``, ``test_launch.py``, ...)."""
from __future__ import annotations

import os
import subprocess
import sys

import pytest
from hydra.errors import ConfigCompositionException

from hybridtrain import cli
from hybridtrain.config import CONF_DIR, Config, to_config


def test_compose_is_the_typed_config_of_the_composed_tree():
    overrides = ["+recipe=gpt_tiny", "parallel.tp=2", "trainer.max_steps=7"]
    cfg = cli.compose(overrides)
    assert isinstance(cfg, Config)
    assert (cfg.model.model_type, cfg.parallel.tp, cfg.trainer.max_steps) == ("gpt2", 2, 7)
    assert cfg == to_config(cli.compose_raw(overrides))
    assert cli.compose(tuple(overrides)) == cfg  # any sequence
    assert cli.compose([]).model.model_type != "" and cli.REPO == CONF_DIR.parent


def test_compose_rejects_an_unknown_key_as_hydra_does():
    with pytest.raises(ConfigCompositionException, match="paralel"):
        cli.compose(["+recipe=gpt_tiny", "paralel.tp=2"])


def test_command_names_the_run_directory_unless_none():
    assert cli.command("/runs/a", ["+recipe=gpt_tiny"]) == [sys.executable, "-m", "hybridtrain",
                                                            "hydra.run.dir=/runs/a", "+recipe=gpt_tiny"]
    assert cli.command(None, ["-m", "parallel.tp=1,2"]) == [sys.executable, "-m", "hybridtrain", "-m",
                                                            "parallel.tp=1,2"]


def test_environment_puts_this_checkout_first_and_env_on_top(monkeypatch):
    monkeypatch.setenv("PYTHONPATH", "/elsewhere")
    env = cli.environment({"HYBRIDTRAIN_CACHE": "/tmp/c"}, path_first=["/inject"])
    assert env["PYTHONPATH"].split(os.pathsep) == ["/inject", str(cli.REPO), "/elsewhere"]
    assert env["PYTHONUNBUFFERED"] == "1" and env["HYBRIDTRAIN_CACHE"] == "/tmp/c"
    assert cli.environment({"PYTHONPATH": "/only"})["PYTHONPATH"] == "/only"  # the caller's value wins


def test_a_failure_shows_the_command_and_the_end_of_the_output():
    proc = subprocess.CompletedProcess(["python", "-m", "hybridtrain", "x=1"], 2, "a" * 7000 + "OUT", "ERR")
    text = cli.describe(proc)
    assert text.startswith("python -m hybridtrain x=1 exited 2\n--- stdout\n")
    assert text.endswith("OUT\n--- stderr\nERR") and "a" * 5997 + "OUT" in text and "a" * 5998 + "OUT" not in text
    assert issubclass(cli.RunFailed, AssertionError)  # a failed run fails a test like an assert
