"""Observability through the real command line: metrics keys and values, the pipeline timeline,
report.md and the TensorBoard / W&B offline loggers (``docs/observability.md``)."""
from __future__ import annotations

import json
from pathlib import Path

import pytest

from hybridtrain.rundir import RunDir
from helpers.config import compose
from helpers.launch import metrics, run_cli


STAGE_KEYS = ("stage_forward_s", "stage_backward_s", "stage_comm_s", "stage_optimizer_s")


@pytest.fixture(scope="module")
def pipe_run(tmp_path_factory) -> Path:
    """gpt_tiny at pp=2 (12 micro-batches), steps 2 and 3 profiled, validation at the end, TensorBoard."""
    d = tmp_path_factory.mktemp("observe_pp2")
    run_cli(d / "run", "+recipe=gpt_tiny", "parallel.pp=2", "trainer.max_steps=4", "trainer.profile_steps=[2,3]",
            "trainer.save_final=false", "data.val_fraction=0.003", "logger=tensorboard", f"data.cache_dir={d / 'cache'}",
            "trainer.report=true")
    return d / "run"


def _train(run_dir: Path) -> list[dict]:
    return [m for m in metrics(run_dir) if "loss" in m]


def test_metrics_keys_and_values(pipe_run):
    train = _train(pipe_run)
    observe = RunDir(pipe_run).observe()
    plan = RunDir(pipe_run).plan_record()
    from hybridtrain.models.families import GPT2
    from hybridtrain.plan import model_config
    from hybridtrain.plan.flops import model_flops_per_token

    cfg = compose("+recipe=gpt_tiny", "parallel.pp=2")
    assert observe["model_flops_per_token"] == model_flops_per_token(GPT2, model_config(cfg), 32, plan["vocab_size"])
    assert observe["peak_tflops"] > 0 and "cpu matmul probe" in observe["peak_source"]
    assert [m["step"] for m in train] == [1, 2, 3, 4]
    for m in train:
        # tokens/s and TFLOP/s are the same measurement: model FLOPs x tokens / time / devices
        assert m["tflops_per_device"] * 1e12 == pytest.approx(
            observe["model_flops_per_token"] * m["tokens_per_sec"] / plan["world_size"], rel=1e-9)
        assert 0 < m["mfu"] <= 1 and m["mfu"] == pytest.approx(m["tflops_per_device"] / observe["peak_tflops"])
        for key in STAGE_KEYS:
            assert len(m[key]) == 2 and all(v >= 0 for v in m[key])
        for s in range(2):
            assert m["stage_forward_s"][s] > 0 and m["stage_backward_s"][s] > 0
            parts = sum(m[k][s] for k in STAGE_KEYS)
            assert parts <= m["stage_step_time_s"][s] * 1.02 + 1e-3, (s, m)
        assert m["stage_comm_s"][1] > 0  # the last stage receives every activation
        assert m["stage_step_time_s"][0] == pytest.approx(m["step_time_s"])  # stage 0 is rank 0 alone here
        assert len(m["rank_rss_bytes"]) == 2 and min(m["rank_rss_bytes"]) > 100 * 2**20
        assert m["rss_max_bytes"] == max(m["rank_rss_bytes"])
        assert m["rank_model_state_bytes"][0] == m["model_state_bytes"]["total"] and min(m["rank_model_state_bytes"]) > 0
        assert m["data_wait_max_s"] >= m["data_wait_s"] >= 0
        assert "rank_gpu_peak_bytes" not in m  # CPU run: no GPU fields


def test_timeline_has_every_micro_batch_of_every_stage(pipe_run):
    summary = RunDir(pipe_run).timeline()
    assert summary["steps"] == [2, 3] and summary["micro_batches"] == 12
    assert summary["bubble_theory"] == pytest.approx(1 / 13) and 0 < summary["bubble_measured"] < 1
    assert RunDir(pipe_run).timeline_png.stat().st_size > 10_000
    trace = json.loads(RunDir(pipe_run).timeline_trace.read_text())
    spans = [e for e in trace["traceEvents"] if e["ph"] == "X"]
    seen = {(e["args"]["step"], e["pid"], e["cat"], e["args"]["micro_batch"]) for e in spans}
    for step in (2, 3):
        for stage in (0, 1):
            for kind in ("forward", "backward"):
                assert {(step, stage, kind, i) for i in range(12)} <= seen
        assert {(step, 0, "send_act", i) for i in range(12)} <= seen
        assert {(step, 1, "recv_act", i) for i in range(12)} <= seen
        assert {(step, s, "optimizer", 0) for s in (0, 1)} <= seen
    # one time origin for both ranks: stage 1 cannot start a micro-batch before stage 0 finished it
    fwd = {(e["args"]["step"], e["pid"], e["args"]["micro_batch"]): e for e in spans if e["cat"] == "forward"}
    for step in (2, 3):
        for i in range(12):
            first, second = fwd[(step, 0, i)], fwd[(step, 1, i)]
            assert second["ts"] >= first["ts"] + first["dur"] - 20_000  # 20 ms for the barrier's skew


def test_report_and_tensorboard(pipe_run):
    text = RunDir(pipe_run).report_file.read_text()
    assert "## Findings" in text and "![timeline](timeline.png)" in text and "validation loss (last)" in text
    for png in ("loss", "throughput", "mfu", "memory", "stages"):
        assert (RunDir(pipe_run).report_dir / f"{png}.png").is_file(), png
    from tensorboard.backend.event_processing.event_accumulator import EventAccumulator

    events = EventAccumulator(str(RunDir(pipe_run).tensorboard_dir)).Reload()
    tags = set(events.Tags()["scalars"])
    assert {"loss", "mfu", "tokens_per_sec", "stage_forward_s/1", "rank_rss_bytes/1", "val_loss"} <= tags
    assert [e.step for e in events.Scalars("loss")] == [1, 2, 3, 4]
    assert events.Scalars("loss")[0].value == pytest.approx(_train(pipe_run)[0]["loss"], rel=1e-6)


def test_sequential_data_parallel_run_with_wandb_offline(tmp_path):
    """pp=1, dp=2: forward/backward timed in the loop, both ranks' memory gathered, a W&B offline run."""
    run_dir = tmp_path / "run"
    run_cli(run_dir, "+recipe=gpt_tiny", "parallel.dp=2", "trainer.max_steps=3", "trainer.profile_steps=[3]",
            "trainer.save_final=false", "trainer.peak_tflops=0.5", "logger=wandb", "trainer.report=true",
            f"data.cache_dir={tmp_path / 'cache'}", env={"WANDB_MODE": "online"})  # forced offline anyway
    train = _train(run_dir)
    for m in train:
        assert len(m["stage_forward_s"]) == 1 and m["stage_forward_s"][0] > 0 and m["stage_comm_s"] == [0.0]
        assert m["mfu"] == pytest.approx(m["tflops_per_device"] / 0.5)
        assert len(m["rank_rss_bytes"]) == 2 and len(m["rank_model_state_bytes"]) == 2
    assert RunDir(run_dir).observe()["peak_source"] == "trainer.peak_tflops"
    trace = json.loads(RunDir(run_dir).timeline_trace.read_text())
    fwd = {(e["tid"], e["args"]["micro_batch"]) for e in trace["traceEvents"] if e.get("cat") == "forward"}
    assert fwd == {(r, i) for r in (0, 1) for i in range(6)}  # 12 = 1 x 6 x dp 2
    runs = list((run_dir / "wandb").glob("offline-run-*/run-*.wandb"))
    assert len(runs) == 1 and runs[0].stat().st_size > 0
    assert not list((run_dir / "wandb").glob("run-*"))  # never an online run
    assert RunDir(run_dir).report_file.is_file()
