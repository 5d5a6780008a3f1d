"""Planning against real runs: ``python -m hybridtrain.verify`` on a 3D plan, and the plan's
model-state estimate against the bytes the ranks really hold (within 10%).

The verify run gives two layouts for free ((2, 2, 2) ZeRO-1 and its (1, 1, 1) reference, ZeRO-0, the
default with one replica);
one more launch adds (2, 1, 1) ZeRO-1, where the optimizer state is partitioned over dp."""
from __future__ import annotations

import json
import subprocess
import sys

import pytest

from hybridtrain.rundir import RunDir
from helpers.launch import REPO, metrics, run_cli


@pytest.fixture(scope="module")
def verified(tmp_path_factory):
    out = tmp_path_factory.mktemp("verify")
    cmd = [sys.executable, "-m", "hybridtrain.verify", "+recipe=gpt_tiny", "parallel.dp=2", "parallel.tp=2",
           "parallel.pp=2", "--steps", "2", "--out", str(out)]
    proc = subprocess.run(cmd, cwd=REPO, capture_output=True, text=True, timeout=600)
    return proc, out


def test_verify_3d_plan_trains_like_one_process(verified):
    proc, out = verified
    assert proc.returncode == 0, proc.stdout[-4000:] + proc.stderr[-4000:]
    assert "OK, the plan trains like one process" in proc.stdout
    assert proc.stdout.count("verify: step ") == 2
    twin = RunDir(out / "plan").plan_record()
    assert (twin["dp"], twin["tp"], twin["pp"], twin["num_layers"]) == (2, 2, 2, 2)
    single = RunDir(out / "single").plan_record()
    assert (single["dp"], single["tp"], single["pp"]) == (1, 1, 1)
    assert single["global_batch_size"] == twin["global_batch_size"]  # the same batches


def _estimate_and_measurement(run_dir):
    from hybridtrain.plan.estimate import estimate_for_run

    est = estimate_for_run(run_dir)
    measured = metrics(run_dir)[-1]["model_state_bytes"]  # rank 0 = stage 0, tp rank 0, dp rank 0
    return est, measured


def test_model_state_estimate_within_10_percent_of_real_allocations(verified, tmp_path):
    _, out = verified
    run_cli(tmp_path / "dp2", "+recipe=gpt_tiny", "parallel.dp=2", "parallel.zero_stage=1", "trainer.max_steps=2",
            "optim.warmup_steps=1", "trainer.save_final=false")
    checked = []
    for run_dir in (out / "plan", out / "single", tmp_path / "dp2"):
        est, measured = _estimate_and_measurement(run_dir)
        assert set(measured) == {"params", "grads", "optim", "total"}
        assert measured["params"] > 0 and measured["grads"] > 0 and measured["optim"] > 0
        assert abs(est.model_state - measured["total"]) <= 0.10 * measured["total"], (run_dir.name, est, measured)
        checked.append(run_dir.name)
    assert checked == ["plan", "single", "dp2"]


@pytest.mark.slow  # CI keeps the fp32 estimate against real allocations (above)
def test_bf16_model_state_estimate_follows_the_bf16_optimizer(tmp_path):
    """bf16 with ZeRO-1 runs DeepSpeed's BF16 optimizer (fp32 gradient accumulation): bf16 gradients
    plus a full fp32 gradient buffer, master weights and moments partitioned over dp."""
    run_cli(tmp_path, "+recipe=gpt_tiny", "parallel.dp=2", "trainer.precision=bf16", "trainer.max_steps=2",
            "optim.warmup_steps=1", "trainer.save_final=false")
    est, measured = _estimate_and_measurement(tmp_path)
    assert json.loads((tmp_path / "plan.json").read_text())["zero_stage"] == 1
    assert abs(est.grads - measured["grads"]) <= 0.02 * measured["grads"], (est, measured)
    assert abs(est.model_state - measured["total"]) <= 0.10 * measured["total"], (est, measured)
