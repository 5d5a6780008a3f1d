"""A signal that arrives while a checkpoint is being written (the probe's n52 and n53, kept pinned).

``tests/fault_inject/sitecustomize.py`` (``HT_FAULT=pause``) holds rank 0 inside DeepSpeed's save of
step 2 for a few seconds, its ``.tmp-step_2`` folder already there; the test signals the controller then.
"""
from __future__ import annotations

import json
import os
import signal
import subprocess
import time
from pathlib import Path

import pytest

from hybridtrain import cli
from hybridtrain.rundir import RunDir
from helpers.launch import REPO

INJECT = Path(__file__).resolve().parents[1] / "fault_inject"
COMMON = ("+recipe=gpt_tiny", "trainer.max_steps=3", "trainer.save_every=1", "optim.warmup_steps=0",
          "trainer.report=false")


def _paused_run(run_dir: Path, stamp: Path) -> subprocess.Popen:
    """A 3-step gpt_tiny run saving every step, whose save of step 2 waits 8 s once ``stamp`` is written;
    its output goes to ``stamp``'s folder (``out.txt``: a file, which no dying rank can block)."""
    path = os.pathsep.join(p for p in (str(INJECT), str(REPO), os.environ.get("PYTHONPATH", "")) if p)
    env = {"PYTHONPATH": path, "HT_FAULT": "pause", "HT_FAULT_RANK": "0", "HT_FAULT_AT": "2",
           "HT_FAULT_STAMP": str(stamp), "HT_FAULT_PAUSE": "8"}
    with open(stamp.parent / "out.txt", "w") as out:
        return cli.start(run_dir, COMMON, env=env, cwd=REPO, stdout=out, stderr=subprocess.STDOUT,
                         start_new_session=True)


def _output(stamp: Path) -> str:
    return (stamp.parent / "out.txt").read_text()


def _wait_for(path: Path, proc: subprocess.Popen, timeout: float = 300) -> None:
    end = time.monotonic() + timeout
    while not path.exists():
        if proc.poll() is not None or time.monotonic() > end:
            proc.kill()
            raise AssertionError(f"the save of step 2 never started (exit {proc.poll()}):\n{_output(path)[-4000:]}")
        time.sleep(0.05)


def _left_behind(run_dir: Path) -> list[str]:
    out = subprocess.run(["pgrep", "-af", str(run_dir)], capture_output=True, text=True)
    return [ln for ln in out.stdout.splitlines() if "pgrep" not in ln]


def _records(run_dir: Path) -> list[dict]:
    return [json.loads(line) for line in RunDir(run_dir).metrics_file.read_text().splitlines()]


def test_sigterm_during_a_save_finishes_it_and_stops_there(tmp_path):
    """SIGTERM to the controller while step 2 is being written: the save completes and is published
    (step_1, step_2, ``latest`` = step_2, no ``.tmp-step_2``), the run says where it stopped, exits 0,
    and leaves no process."""
    run_dir, stamp = tmp_path / "run", tmp_path / "stamp"
    proc = _paused_run(run_dir, stamp)
    _wait_for(stamp, proc)
    ckpts = RunDir(run_dir).checkpoints
    assert (ckpts / ".tmp-step_2").is_dir()
    proc.send_signal(signal.SIGTERM)
    proc.wait(timeout=200)
    out = _output(stamp)
    assert proc.returncode == 0, out[-4000:]
    assert f"stopped by SIGTERM after step 2; checkpoint {ckpts / 'step_2'}" in out, out[-4000:]
    assert "Traceback" not in out
    assert sorted(p.name for p in ckpts.iterdir()) == ["latest", "step_1", "step_2"]
    assert (ckpts / "latest").read_text() == "step_2" and (ckpts / "step_2" / "meta.json").is_file()
    assert _left_behind(run_dir) == []


def test_sigkill_during_a_save_keeps_the_last_checkpoint_and_auto_resumes_exactly(tmp_path):
    """SIGKILL to the controller while step 2 is being written: its ranks die with it, the partial
    ``.tmp-step_2`` is never published (``latest`` stays step_1), and ``trainer.resume=auto`` goes on
    from step_1: its step 2 gives the killed run's logged step-2 loss, bit for bit (the same state, data
    position and RNG), then trains to the end."""
    run_dir, stamp = tmp_path / "run", tmp_path / "stamp"
    proc = _paused_run(run_dir, stamp)
    _wait_for(stamp, proc)
    killed = _records(run_dir)
    os.kill(proc.pid, signal.SIGKILL)
    proc.wait(timeout=60)
    end = time.monotonic() + 30
    while _left_behind(run_dir) and time.monotonic() < end:
        time.sleep(0.2)
    assert _left_behind(run_dir) == []
    ckpts = RunDir(run_dir).checkpoints
    assert (ckpts / "latest").read_text() == "step_1" and not (ckpts / "step_2").exists()
    assert [r["step"] for r in killed if "loss" in r] == [1, 2]
    resumed = cli.run(run_dir, [*COMMON, "trainer.resume=auto"], cwd=REPO, timeout=300)
    assert f"resume: {ckpts / 'step_1'}" in resumed.stdout
    after = [r for r in _records(run_dir)[len(killed):] if "loss" in r]
    assert [r["step"] for r in after] == [2, 3]
    assert after[0]["loss"] == pytest.approx(killed[1]["loss"], rel=1e-6)
    assert not (ckpts / ".tmp-step_2").exists() and (ckpts / "latest").read_text() == "step_3"
