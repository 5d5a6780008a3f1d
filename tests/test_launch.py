"""Launch behaviour: a dead rank ends the whole job with a non-zero exit and leaves nothing behind."""
from __future__ import annotations

import subprocess
import time

import pytest

from launch_helpers import run_cli

pytestmark = pytest.mark.dist

# Loaded by every Python process started with this PYTHONPATH; only the worker with RANK=1 has
# the variable set (launch.py sets RANK for its children), and it SIGKILLs itself after a delay.
SITECUSTOMIZE = """
import os, signal, threading
if os.environ.get("RANK") == "1" and os.environ.get("HT_TEST_KILL_AFTER"):
    t = threading.Timer(float(os.environ["HT_TEST_KILL_AFTER"]), lambda: os.kill(os.getpid(), signal.SIGKILL))
    t.daemon = True
    t.start()
"""


def _workers_of(run_dir) -> list[str]:
    out = subprocess.run(["pgrep", "-af", f"hybridtrain.worker {run_dir}"], capture_output=True, text=True)
    return [ln for ln in out.stdout.splitlines() if "pgrep" not in ln]


def test_killed_rank_ends_job_nonzero_without_hang(tmp_path):
    inject = tmp_path / "inject"
    inject.mkdir()
    (inject / "sitecustomize.py").write_text(SITECUSTOMIZE)
    run_dir = tmp_path / "run"
    t0 = time.monotonic()
    proc = run_cli(run_dir, "+recipe=gpt_tiny", "parallel.tp=2", "parallel.pp=2", "trainer.max_steps=1000000",
                   "launcher.timeout_minutes=2", check=False, timeout=240,
                   env={"PYTHONPATH": str(inject), "HT_TEST_KILL_AFTER": "20"})
    elapsed = time.monotonic() - t0
    assert proc.returncode != 0, proc.stdout[-3000:]
    assert "training failed" in proc.stderr and str(run_dir) in proc.stderr
    assert elapsed < 200, f"job took {elapsed:.0f}s to notice the dead rank"
    time.sleep(1)
    assert _workers_of(run_dir) == [], "worker processes left behind"


def test_bad_plan_launches_nothing(tmp_path):
    proc = run_cli(tmp_path, "+recipe=gpt_tiny", "parallel.tp=4", check=False, timeout=120)
    assert proc.returncode == 2
    assert "parallel.tp=4 must divide model.config.n_head=6" in proc.stderr
    assert "deepspeed.launcher.runner" not in proc.stdout
    assert not (tmp_path / "plan.json").exists()


def test_hydra_multirun_sweep_writes_one_run_per_value(tmp_path):
    import sys

    from launch_helpers import REPO

    proc = subprocess.run([sys.executable, "-m", "hybridtrain", "-m", "+recipe=gpt_tiny", "parallel.tp=1,2",
                           "launcher.dry_run=true", f"hydra.sweep.dir={tmp_path}"],
                          cwd=REPO, capture_output=True, text=True, timeout=180)
    assert proc.returncode == 0, proc.stderr[-3000:]
    from hybridtrain.config import load_config

    tps = sorted(load_config(p).parallel.tp for p in tmp_path.glob("*/config.yaml"))
    assert tps == [1, 2]


def test_console_script_is_installed(tmp_path):
    import shutil

    exe = shutil.which("hybridtrain")
    assert exe, "the `hybridtrain` console script is not on PATH (pip install -e . installs it)"
    proc = subprocess.run([exe, "+recipe=gpt_tiny", "launcher.dry_run=true", f"hydra.run.dir={tmp_path}"],
                          capture_output=True, text=True, timeout=120)
    assert proc.returncode == 0, proc.stderr[-3000:]
    assert (tmp_path / "config.yaml").exists() and (tmp_path / "plan.json").exists()


def test_multi_node_plan_is_refused_by_the_local_launcher_before_anything_runs(tmp_path):
    proc = run_cli(tmp_path, "+recipe=gpt_tiny", "launcher.nodes=2", check=False, timeout=120)
    assert proc.returncode == 2
    assert "launcher.nodes=2" in proc.stderr and "dry_run" in proc.stderr
    assert not (tmp_path / "config.yaml").exists()
