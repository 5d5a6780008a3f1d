"""Observability through real processes: the CPU probe sees busy cores, ``python -m hybridtrain.report``,
and the CLI stopping before any worker when a logger package is missing."""
from __future__ import annotations

import json
import os
import subprocess
import sys


from helpers.config import ROOT
from hybridtrain.rundir import RunDir


def _record(step, **kw):
    rec = {"step": step, "loss": 5.0 - 0.1 * step, "step_time_s": 1.0, "tokens_per_sec": 100.0,
           "data_wait_s": 0.0, "data_wait_max_s": 0.0, "mfu": 0.3, "tflops_per_device": 3.0,
           "stage_forward_s": [0.2, 0.2], "stage_backward_s": [0.4, 0.4], "stage_comm_s": [0.1, 0.1],
           "stage_optimizer_s": [0.05, 0.05], "stage_step_time_s": [1.0, 1.0],
           "rank_rss_bytes": [2**30, 2**30], "rss_max_bytes": 2**30, "rank_model_state_bytes": [2**20, 2**20]}
    rec.update(kw)
    return rec


def test_cpu_probe_sees_other_processes_busy(tmp_path):
    import time

    from hybridtrain.observe.peak import CONTENDED, measure_matmul_tflops

    spin = "import time\nt = time.time()\nwhile time.time() - t < 20: pass\n"
    hogs = [subprocess.Popen([sys.executable, "-c", spin]) for _ in range(os.cpu_count() or 1)]
    try:
        time.sleep(0.5)  # the spinners are running
        tflops, others = measure_matmul_tflops(1, "fp32", n=256, seconds=1.0)
    finally:
        for h in hogs:
            h.kill()
            h.wait()
    assert tflops > 0 and others > CONTENDED, others  # every core had a spinner on it during the probe


def test_report_command(tmp_path):
    cmd = [sys.executable, "-m", "hybridtrain.report"]
    missing = subprocess.run(cmd + [str(tmp_path)], cwd=ROOT, capture_output=True, text=True)
    assert missing.returncode == 2 and "metrics.jsonl does not exist" in missing.stderr
    RunDir(tmp_path).metrics_file.write_text(json.dumps(_record(1)) + "\n")
    done = subprocess.run(cmd + [str(tmp_path)], cwd=ROOT, capture_output=True, text=True)
    assert done.returncode == 0 and RunDir(tmp_path).report_file.is_file(), done.stderr


def test_cli_stops_before_workers_when_wandb_is_missing(tmp_path):
    # The real CLI, with the wandb package made unimportable the way a missing package is.
    code = ("import sys; sys.modules['wandb'] = None; sys.argv = ['hybridtrain'] + sys.argv[1:]; "
            "from hybridtrain.__main__ import main; main()")
    proc = subprocess.run([sys.executable, "-c", code, "+recipe=gpt_tiny", "logger=wandb",
                           f"hydra.run.dir={tmp_path / 'run'}"], cwd=ROOT, capture_output=True, text=True,
                          env={**os.environ, "HYBRIDTRAIN_CACHE": str(tmp_path / "cache")}, timeout=120)
    assert proc.returncode == 2, proc.stderr[-2000:]
    assert "config error: logger.name: logger=wandb needs the wandb package" in proc.stderr
    assert "launching" not in proc.stdout and not RunDir(tmp_path / "run").plan_file.exists()
