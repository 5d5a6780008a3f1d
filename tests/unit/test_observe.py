"""Observability pieces in one process: the GPU peak table, the cached CPU probe, the bubble,
the Chrome trace, the report's findings and files, the loggers' checks and the launch-time errors."""
from __future__ import annotations

import json
import sys

import pytest

from helpers.config import compose
from hybridtrain.parallel.dims import pipeline_bubble
from hybridtrain.observe import timeline
from hybridtrain.observe.checks import check_observe
from hybridtrain.observe.loggers import check_logger, scalars
from hybridtrain.observe.peak import gpu_peak_tflops, probe_cpu_tflops, probe_key, resolve_peak
from hybridtrain.errors import PlanError
from hybridtrain.plan import Machine, resolve
from hybridtrain.report import write_report
from hybridtrain.report.findings import findings
from hybridtrain.rundir import RunDir


# -- peak ----------------------------------------------------------------------------------------

@pytest.mark.parametrize("name, precision, key, tflops", [
    ("NVIDIA H100 80GB HBM3", "bf16", "H100", 989.4),
    ("NVIDIA H100 PCIe", "bf16", "H100 PCIe", 756.5),  # the longer name wins over "H100"
    ("NVIDIA H100 NVL", "fp32", "H100 NVL", 60.0),
    ("NVIDIA H200", "fp16", "H200", 989.4),  # fp16 takes the bf16 rate
    ("NVIDIA A100-SXM4-80GB", "fp32", "A100", 19.5),
    ("NVIDIA A100 80GB PCIe", "bf16", "A100", 312.0),
    ("NVIDIA L40S", "bf16", "L40S", 362.1),
    ("NVIDIA L4", "fp32", "L4", 30.3),
])
def test_gpu_peak_table(name, precision, key, tflops):
    assert gpu_peak_tflops(name, precision) == (key, tflops)


@pytest.mark.parametrize("name, precision, tf32, key, tflops", [
    ("NVIDIA H200 NVL", "bf16", False, "H200 NVL", 835.5),  # NVL before the SXM entry
    ("NVIDIA H200", "fp32", True, "H200", 494.7),  # fp32 with TF32 matmuls: the TF32 rate
    ("NVIDIA H200", "fp32", False, "H200", 66.9),
    ("NVIDIA H100 NVL", "fp32", True, "H100 NVL", 417.5),
    ("NVIDIA H100 PCIe", "fp32", True, "H100 PCIe", 378.0),
    ("NVIDIA L40", "bf16", False, "L40", 181.0),  # not L4, not L40S
    ("NVIDIA GB200", "bf16", False, "GB200", 2500.0),  # not B200
    ("NVIDIA B200", "fp32", True, "B200", 1125.0),
    ("Tesla V100-SXM2-32GB", "fp32", True, "V100", 15.7),  # no TF32 units: plain fp32
])
def test_gpu_peak_table_tf32_and_newer_gpus(name, precision, tf32, key, tflops):
    assert gpu_peak_tflops(name, precision, tf32) == (key, tflops)
    assert resolve_peak(None, precision, name, None, 1, tf32).source == f"table: {key} " + (
        "bf16" if precision != "fp32" else "tf32" if tf32 else "fp32")


def test_peak_resolution_order(tmp_path):
    cache = tmp_path / "peak.json"
    assert resolve_peak(123.0, "bf16", "NVIDIA H100", cache, 1).tflops == 123.0  # trainer.peak_tflops wins
    table = resolve_peak(None, "bf16", "NVIDIA H100 80GB HBM3", cache, 1)
    assert table.tflops == 989.4 and table.source == "table: H100 bf16"
    unknown = resolve_peak(None, "bf16", "Tesla T4", cache, 1)
    assert unknown.tflops is None and "trainer.peak_tflops" in unknown.source
    assert not cache.exists()  # GPUs never probe


def test_cpu_probe_is_measured_once_and_cached_per_thread_count(tmp_path, monkeypatch):
    from hybridtrain.observe import peak as peak_mod

    monkeypatch.setattr(peak_mod, "_busy_cpu_seconds", lambda: None)  # no /proc/stat: counted as quiet
    cache = tmp_path / "sub" / "peak_tflops.json"
    first, cached = probe_cpu_tflops(cache, 1, "fp32")
    assert not cached and 1e-4 < first < 50  # a real matmul rate of one CPU thread, in TFLOP/s
    again, cached = probe_cpu_tflops(cache, 1, "fp32")
    assert cached and again == first
    stored = json.loads(cache.read_text())
    assert stored == {probe_key(1, "fp32"): {"tflops": first, "quiet": True, "probes": 1}}
    assert len({probe_key(1, "fp32"), probe_key(2, "fp32"), probe_key(1, "bf16")}) == 3  # threads, dtype: own entries
    cache.write_text(json.dumps({probe_key(1, "fp32"): {"tflops": 42.0, "quiet": True}}))  # the file is the truth
    peak = resolve_peak(None, "fp32", None, cache, 1)
    assert peak.tflops == 42.0 and "cached in" in peak.source and "measured now" not in peak.source
    cache.write_text("{torn")  # an unreadable cache is measured again, not an error
    assert probe_cpu_tflops(cache, 1, "fp32")[1] is False


def test_cpu_probe_on_a_busy_machine_is_repeated_and_keeps_the_fastest(tmp_path, monkeypatch):
    from hybridtrain.observe import peak as peak_mod

    cache, key = tmp_path / "peak.json", probe_key(1, "fp32")
    probes = iter([(1.0, 0.5), (1.5, 0.5), (2.0, 0.0)])  # (TFLOP/s, share of the cores others used)
    monkeypatch.setattr(peak_mod, "measure_matmul_tflops", lambda threads, precision: next(probes))
    assert probe_cpu_tflops(cache, 1, "fp32") == (2.0, False)  # half the cores: the rate scaled up 2x
    assert json.loads(cache.read_text())[key] == {"tflops": 2.0, "quiet": False, "probes": 1}
    assert probe_cpu_tflops(cache, 1, "fp32") == (3.0, False)  # busy again: measured again, the faster kept
    assert probe_cpu_tflops(cache, 1, "fp32") == (3.0, False)  # quiet now, slower than the best: best kept
    assert json.loads(cache.read_text())[key] == {"tflops": 3.0, "quiet": True, "probes": 3}
    assert probe_cpu_tflops(cache, 1, "fp32") == (3.0, True)  # a quiet probe is final
    cache.write_text(json.dumps({key: 0.5}))  # the first format, a bare number taken under unknown load
    monkeypatch.setattr(peak_mod, "measure_matmul_tflops", lambda threads, precision: (2.5, 0.0))
    assert probe_cpu_tflops(cache, 1, "fp32") == (2.5, False)


def test_cpu_probe_on_a_machine_that_is_never_quiet_stops_after_max_probes(tmp_path, monkeypatch):
    from hybridtrain.observe import peak as peak_mod

    cache, measured = tmp_path / "peak.json", []
    monkeypatch.setattr(peak_mod, "measure_matmul_tflops",
                        lambda threads, precision: measured.append(1) or (1.0 + len(measured), 0.5))
    got = [probe_cpu_tflops(cache, 1, "fp32") for _ in range(peak_mod.MAX_PROBES + 2)]
    assert len(measured) == peak_mod.MAX_PROBES  # then the entry is kept: no run probes again
    best = 2.0 * (1.0 + peak_mod.MAX_PROBES)  # the fastest contended probe, scaled up for half the cores
    assert got[-2:] == [(best, True), (best, True)] and got[peak_mod.MAX_PROBES - 1] == (best, False)


def test_cpu_mfu_never_shows_above_100_percent():
    """A probe slowed down by other processes is a lower bound of the peak: a step that beats it
    raises the peak (the first run of a new user showed 143%); table peaks are kept as given."""
    from hybridtrain.observe.peak import Peak

    probed = Peak(1.0, "cpu matmul probe", probed=True)
    assert probed.mfu(0.5) == 0.5
    assert probed.mfu(1.43) == 1.0 and probed.tflops == 1.43 and "raised" in probed.source
    assert probed.mfu(0.715) == pytest.approx(0.5)
    table = Peak(10.0, "table: H100 bf16")
    assert table.mfu(12.0) == pytest.approx(1.2)  # a FLOP count above a data-sheet peak stays visible
    assert Peak(None, "unknown GPU").mfu(1.0) is None




def test_gpu_readings_are_absent_on_cpu():
    import torch

    from hybridtrain.observe.resources import NvmlSampler, gpu_peak_bytes, rss_bytes

    cpu = torch.device("cpu")
    assert NvmlSampler.create(cpu) is None and gpu_peak_bytes(cpu) is None
    assert rss_bytes() > 10 * 2**20  # this process, with torch imported


# -- bubble and trace ----------------------------------------------------------------------------

def gpipe_events(pp: int, m: int, f: float = 1.0, b: float = 2.0, rank_offset: int = 0) -> list[dict]:
    """A GPipe step with equal stages: all forwards (stage s runs micro-batch i at (i + s) f), then
    all backwards in reverse stage order. Its idle fraction is exactly (pp - 1) / (m + pp - 1)."""
    ev = []
    t_f = (m + pp - 1) * f
    for s in range(pp):
        for i in range(m):
            ev.append(dict(rank=s + rank_offset, stage=s, dp_rank=0, tp_rank=0, step=1, kind="forward",
                           micro_batch=i, start=(i + s) * f, end=(i + s + 1) * f))
            t0 = t_f + (i + pp - 1 - s) * b
            ev.append(dict(rank=s + rank_offset, stage=s, dp_rank=0, tp_rank=0, step=1, kind="backward",
                           micro_batch=i, start=t0, end=t0 + b))
    return ev


@pytest.mark.parametrize("pp, m", [(2, 1), (2, 4), (4, 12), (3, 5)])
def test_measured_bubble_of_an_ideal_schedule_is_the_theory(pp, m):
    mean, per_stage = timeline.measured_bubble(gpipe_events(pp, m))
    assert mean == pytest.approx(pipeline_bubble(pp, m), rel=1e-12)
    assert per_stage == pytest.approx([(pp - 1) / (m + pp - 1)] * pp)


def test_bubble_uses_one_rank_per_stage_and_counts_waiting_as_idle():
    ev = gpipe_events(2, 4)
    noisy = [dict(e, rank=e["rank"] + 10, start=e["start"] + 0.5, end=e["end"] + 9.0) for e in ev]  # dp peers
    comm = [dict(ev[0], kind="recv_grad", start=0.0, end=100.0)]  # communication is not compute
    assert timeline.measured_bubble(ev + noisy + comm)[0] == pytest.approx(1 / 5)
    assert pipeline_bubble(2, 1) == 0.5 and pipeline_bubble(4, 12) == pytest.approx(0.2)


def test_chrome_trace_has_a_process_per_stage_and_an_event_per_span():
    ev = gpipe_events(3, 2)
    trace = timeline.chrome_trace(ev, {1: 0.0}, {"pp": 3})
    spans = [e for e in trace["traceEvents"] if e["ph"] == "X"]
    names = {(e["args"]["name"]) for e in trace["traceEvents"] if e["ph"] == "M" and e["name"] == "process_name"}
    assert names == {"stage 0", "stage 1", "stage 2"} and len(spans) == len(ev)
    assert {(e["pid"], e["cat"], e["args"]["micro_batch"]) for e in spans} == \
        {(s, k, i) for s in range(3) for k in ("forward", "backward") for i in range(2)}
    fwd = next(e for e in spans if e["pid"] == 1 and e["cat"] == "forward" and e["args"]["micro_batch"] == 1)
    assert fwd["ts"] == pytest.approx(2e6) and fwd["dur"] == pytest.approx(1e6)  # microseconds
    assert trace["otherData"] == {"pp": 3}


def test_timeline_files(tmp_path):
    summary = timeline.write(tmp_path, gpipe_events(2, 3), {1: 0.0}, pp=2, micro_batches=3)
    assert summary["bubble_measured"] == pytest.approx(0.25) and summary["bubble_theory"] == pytest.approx(0.25)
    assert RunDir(tmp_path).timeline_png.stat().st_size > 5000
    assert json.loads(RunDir(tmp_path).timeline_trace.read_text())["otherData"]["steps"] == [1]


# -- findings and the report ---------------------------------------------------------------------

def _record(step, **kw):
    rec = {"step": step, "loss": 5.0 - 0.1 * step, "step_time_s": 1.0, "tokens_per_sec": 100.0,
           "data_wait_s": 0.0, "data_wait_max_s": 0.0, "mfu": 0.3, "tflops_per_device": 3.0,
           "stage_forward_s": [0.2, 0.2], "stage_backward_s": [0.4, 0.4], "stage_comm_s": [0.1, 0.1],
           "stage_optimizer_s": [0.05, 0.05], "stage_step_time_s": [1.0, 1.0],
           "rank_rss_bytes": [2**30, 2**30], "rss_max_bytes": 2**30, "rank_model_state_bytes": [2**20, 2**20]}
    rec.update(kw)
    return rec


def plan_json(folder, *overrides):
    """``plan.json`` as the controller writes it for gpt_tiny on two stages with 16 micro-batches per step."""
    cfg = compose("+recipe=gpt_tiny", "parallel.pp=2", "trainer.global_batch_size=16", *overrides)
    plan, _ = resolve(cfg, Machine())
    RunDir(folder).write_plan(plan)
    return RunDir(folder).plan_record()


@pytest.fixture(scope="module")
def tiny_plan(tmp_path_factory):
    """The default (``balanced``) plan's ``plan.json``."""
    return plan_json(tmp_path_factory.mktemp("plan"))


def titles(found):
    return [f.title for f in found]


def test_findings_balanced_run_has_none(tiny_plan):
    assert titles(findings([_record(s) for s in range(1, 6)], tiny_plan)) == ["Nothing stands out"]


@pytest.mark.parametrize("overrides, method, advice", [
    ((), "balanced", "set the boundaries by hand with parallel.stage_layers (now [6, 2]) or try parallel.partition=blocks"),
    (("parallel.partition=blocks",), "blocks",
     "try parallel.partition=balanced or set the boundaries by hand with parallel.stage_layers (now [4, 4])"),
    (("parallel.stage_layers=[4,4]",), "manual", "change parallel.stage_layers (now [4, 4]) or try parallel.partition=balanced"),
], ids=["balanced", "blocks", "manual"])
def test_findings_name_the_slow_stage_and_the_partition_key(tmp_path, overrides, method, advice):
    plan = plan_json(tmp_path, *overrides)
    assert plan["partition_method"] == method
    recs = [_record(s, stage_forward_s=[0.1, 0.4], stage_backward_s=[0.2, 0.8]) for s in range(1, 6)]
    slow = [f for f in findings(recs, plan) if f.title == "Stage 1 is the slowest"]
    assert slow and slow[0].suggestion == f"move pipeline layers from stage 1 towards stage 0: {advice}, then " \
        "compare the stage times of the two runs."


def test_findings_bubble_data_wait_comm_and_bad_peak(tiny_plan):
    naive = dict(tiny_plan, grad_accum=1)
    recs = [_record(s, data_wait_max_s=0.2, stage_comm_s=[0.5, 0.1], mfu=1.7) for s in range(1, 6)]
    found = findings(recs, naive)
    assert {"Large pipeline bubble", "High data wait", "Much time in pipeline send/receive",
            "MFU above 100%"} <= set(titles(found))
    bubble = next(f for f in found if f.title == "Large pipeline bubble")
    assert "theory (pp-1)/(m+pp-1) = 50%" in bubble.detail and "more micro-batches" in bubble.suggestion
    measured = findings(recs, naive, {"bubble_measured": 0.6})
    assert "measured 60% (theory 50%)" in next(f for f in measured if f.title == "Large pipeline bubble").detail
    gpu = [_record(s, rank_gpu_peak_bytes=[70 * 2**30, 60 * 2**30]) for s in range(1, 6)]
    assert "GPU memory nearly full" in titles(findings(gpu, tiny_plan, gpu_total_bytes=75 * 2**30))
    assert "GPU memory nearly full" not in titles(findings(gpu, tiny_plan, gpu_total_bytes=140 * 2**30))
    diverged = findings([_record(s, loss=float("nan")) for s in range(1, 6)], tiny_plan)
    assert "Loss is not finite" in titles(diverged)


def test_report_from_a_run_directory(tmp_path, tiny_plan):
    recs = [_record(s) for s in range(1, 5)] + [{"step": 4, "val_loss": 4.5, "val_ppl": 90.0}]
    RunDir(tmp_path).metrics_file.write_text("\n".join(json.dumps(r) for r in recs) + "\n")
    RunDir(tmp_path).plan_file.write_text(json.dumps(tiny_plan))
    report = write_report(tmp_path)
    text = report.read_text()
    for png in ("loss", "throughput", "mfu", "memory", "stages"):
        assert f"(report/{png}.png)" in text and (RunDir(tmp_path).report_dir / f"{png}.png").stat().st_size > 3000
    assert "| validation loss (last) | 4.5000 |" in text and "## Findings" in text
    assert "| MFU (median) | 30.00% |" in text


def test_report_of_a_resumed_run_reads_one_history(tmp_path, tiny_plan):
    """Steps 1-4, then a resume from step_2: the report counts 4 steps ending in the resumed run's loss
    and names the resume."""
    ckpt = str(tmp_path / "checkpoints" / "step_2")
    recs = ([_record(s) for s in range(1, 5)] + [{"event": "resume", "step": 2, "checkpoint": ckpt}]
            + [_record(s, loss=1.25) for s in (3, 4)])
    RunDir(tmp_path).metrics_file.write_text("\n".join(json.dumps(r) for r in recs) + "\n")
    RunDir(tmp_path).plan_file.write_text(json.dumps(tiny_plan))
    text = write_report(tmp_path).read_text()
    assert "| steps logged | 4 (last step 4) |" in text and "-> 1.2500 |" in text
    assert f"Resumed at step 2 from `{ckpt}`" in text


def test_a_metrics_line_cut_short_is_skipped_and_the_resume_starts_its_own_line(tmp_path, tiny_plan):
    """Fault probe n72: a killed run left step 4's record cut mid-line; the resume (``trainer.resume=auto``)
    writes its record on a line of its own, the readers skip and count the cut line, and the report is written."""
    from hybridtrain.train.loop import MetricsWriter

    files = RunDir(tmp_path)
    text = "\n".join(json.dumps(_record(s)) for s in range(1, 5))
    files.metrics_file.write_text(text[:-40])  # the last record cut, no newline
    ckpt = str(tmp_path / "checkpoints" / "step_3")
    writer = MetricsWriter(files.metrics_file, append=True)
    writer.mark_resume(3, ckpt)
    writer.write(_record(4, loss=1.25))
    writer.close()
    assert [r["step"] for r in files.metrics()] == [1, 2, 3, 4]
    skipped: list[int] = []
    assert len(files.metric_records(skipped)) == 5 and skipped == [4]  # 3 steps, the resume, step 4
    assert files.resumes() == [{"event": "resume", "step": 3, "checkpoint": ckpt}]
    assert files.losses()[-1] == 1.25
    files.plan_file.write_text(json.dumps(tiny_plan))
    report = write_report(tmp_path).read_text()
    assert "1 line(s) of `metrics.jsonl` could not be read and are left out (line 4: cut short" in report
    assert f"Resumed at step 3 from `{ckpt}`" in report and "| steps logged | 4 (last step 4) |" in report


def test_report_of_an_older_plan_json_reads_the_method_from_config_yaml(tmp_path):
    cfg = compose("+recipe=gpt_tiny", "parallel.pp=2", "parallel.partition=blocks")
    files = RunDir(tmp_path)
    files.write_config(cfg)
    files.plan_file.write_text(json.dumps({k: v for k, v in plan_json(tmp_path, "parallel.partition=blocks").items()
                                           if k != "partition_method"}))
    recs = [_record(s, stage_forward_s=[0.1, 0.4], stage_backward_s=[0.2, 0.8]) for s in range(1, 6)]
    files.metrics_file.write_text("\n".join(json.dumps(r) for r in recs) + "\n")
    assert "try parallel.partition=balanced or set the boundaries" in write_report(tmp_path).read_text()




# -- loggers and launch-time checks --------------------------------------------------------------

def test_scalars_flatten_lists_and_drop_missing_values():
    assert scalars({"step": 3, "loss": 2.0, "mfu": None, "stage_forward_s": [0.1, 0.2], "flag": True}) == \
        {"loss": 2.0, "stage_forward_s/0": 0.1, "stage_forward_s/1": 0.2}


def test_missing_logger_package_is_a_config_error(monkeypatch):
    monkeypatch.setitem(sys.modules, "wandb", None)  # what `import wandb` does when it is not installed
    with pytest.raises(PlanError) as err:
        check_logger("wandb")
    assert err.value.key == "logger.name" and "pip install wandb" in str(err.value)
    with pytest.raises(PlanError, match="logger=none, logger=tensorboard or logger=wandb"):
        check_logger("mlflow")


def test_logger_group_composes():
    cfg = compose("+recipe=gpt_tiny", "logger=wandb", "logger.project=p")
    assert (cfg.logger.name, cfg.logger.project) == ("wandb", "p")
    assert compose("+recipe=gpt_tiny").logger.name == "none"


def test_profile_steps_and_peak_are_checked():
    with pytest.raises(PlanError) as err:
        check_observe(compose("+recipe=gpt_tiny", "trainer.max_steps=4", "trainer.profile_steps=[2,9]"))
    assert err.value.key == "trainer.profile_steps" and "[9]" in str(err.value) and "1..4" in str(err.value)
    with pytest.raises(PlanError, match="trainer.peak_tflops"):
        check_observe(compose("+recipe=gpt_tiny", "trainer.peak_tflops=0"))
    check_observe(compose("+recipe=gpt_tiny", "trainer.profile_steps=[5,6]"))




def test_gpu_spans_are_events_resolved_once_per_step():
    """On a GPU every span is a pair of CUDA events; nothing waits for the device until the step's
    end, where one synchronize on the last event resolves them all (a stand-in event here)."""
    from hybridtrain.observe.clock import StepClock

    synced = []

    class Event:
        clock = iter(range(0, 1000, 10))  # the device time each record() lands on, in ms

        def record(self):
            self.at = next(Event.clock)

        def elapsed_time(self, other):
            return other.at - self.at

        def synchronize(self):
            synced.append(self.at)

    clock = StepClock(events=Event)
    clock.start(record=True)  # origin event at 0 ms
    with clock.span("forward"):
        pass  # 10 .. 20 ms
    with clock.span("backward"):
        pass  # 30 .. 40 ms
    assert clock.totals["forward"] == 0.0 and not synced  # nothing read while the step runs
    clock.stop()
    assert synced == [40]  # one wait, on the last span's end
    assert clock.totals["forward"] == pytest.approx(0.01) and clock.totals["backward"] == pytest.approx(0.01)
    assert clock.events == [("forward", 0, pytest.approx(0.01), pytest.approx(0.02)),
                            ("backward", 0, pytest.approx(0.03), pytest.approx(0.04))]
    with clock.span("forward"):  # inactive: not measured
        pass
    assert len(clock.events) == 2


def test_nvml_samples_the_gpu_by_uuid_not_by_index():
    from hybridtrain.observe.resources import nvml_handle

    class Nvml:
        def nvmlDeviceGetHandleByUUID(self, uuid):
            return ("handle", uuid)

        def nvmlDeviceGetHandleByIndex(self, index):  # pragma: no cover - must not be used
            raise AssertionError("NVML index: another job's GPU under CUDA_VISIBLE_DEVICES")

    assert nvml_handle(Nvml(), "8a1b2c3d-0000-1111-2222-333344445555") == (
        "handle", "GPU-8a1b2c3d-0000-1111-2222-333344445555")  # torch prints it without NVML's prefix
    assert nvml_handle(Nvml(), "MIG-1234")[1] == "MIG-1234"
