"""End-of-run report: ``RUN_DIR/report.md`` with plots in ``RUN_DIR/report/`` and findings.

Written by rank 0 at the end of training (``trainer.report``) and by
``python -m hybridtrain.report RUN_DIR`` for any run directory holding ``metrics.jsonl``. It reads
only files of the run (``metrics.jsonl``, ``plan.json``, ``config.yaml``, ``observe.json``,
``timeline_summary.json``), never the processes.
"""
from __future__ import annotations

from pathlib import Path
from statistics import median

from hybridtrain.report import plots
from hybridtrain.report.findings import findings, stage_times, steady, train_records
from hybridtrain.rundir import RunDir

__all__ = ["write_report"]


def _partition(files: RunDir) -> str | None:
    """The partition method as the run's ``config.yaml`` has it (``manual`` with ``parallel.stage_layers``),
    read leniently (a report of any run directory, whatever schema wrote it)."""
    if not files.config_file.is_file():
        return None
    from omegaconf import OmegaConf

    from hybridtrain.plan.partition import MANUAL

    cfg = OmegaConf.load(str(files.config_file))
    if OmegaConf.select(cfg, "parallel.stage_layers") is not None:
        return MANUAL
    return OmegaConf.select(cfg, "parallel.partition")


def _mib(v: float | None) -> str:
    return "n/a" if v is None else f"{v / 2**20:,.0f} MiB"


def write_report(run_dir: str | Path) -> Path:
    """Write ``report.md`` and its plots for ``run_dir``; return the path of ``report.md``."""
    run_dir = Path(run_dir)
    files = RunDir(run_dir)
    unreadable: list[int] = []
    records = files.metrics(unreadable)  # one history: what a resume replaced is left out
    resumes = files.resumes()
    plan = files.plan_record() or {}
    if not plan.get("partition_method"):  # a plan.json written before the method was recorded
        plan["partition_method"] = _partition(files)
    observe = files.observe() or {}
    timeline = files.timeline()
    train = train_records(records)
    val = [r for r in records if "val_loss" in r]
    rows = steady(records)
    out_dir = files.report_dir
    out_dir.mkdir(exist_ok=True)

    images = [("Loss", plots.loss(train, val, out_dir / "loss.png")),
              ("Throughput", plots.series(train, "tokens_per_sec", "tokens / s", out_dir / "throughput.png"))]
    if any(r.get("mfu") is not None for r in train):
        images.append(("MFU", plots.series(train, "mfu", "MFU (%)", out_dir / "mfu.png", scale=100.0)))
    elif any(r.get("tflops_per_device") is not None for r in train):
        images.append(("Model TFLOP/s per device",
                       plots.series(train, "tflops_per_device", "TFLOP/s per device", out_dir / "tflops.png")))
    last = next((r for r in reversed(train) if r.get("rank_rss_bytes")), None)
    if last is not None:
        images.append(("Memory per rank (last logged step)", plots.memory(last, out_dir / "memory.png")))
    times = stage_times(records)
    if times is not None:
        images.append(("Time per stage", plots.stages(times, out_dir / "stages.png")))

    def med(key: str) -> float | None:
        vals = [r[key] for r in rows if r.get(key) is not None]
        return median(vals) if vals else None

    lines = [f"# Run report: {run_dir.name}", ""]
    if plan:
        lines.append(f"Plan: dp={plan.get('dp')} x tp={plan.get('tp')} x pp={plan.get('pp')} = "
                     f"{plan.get('world_size')} rank(s); global batch {plan.get('global_batch_size')} = micro "
                     f"{plan.get('micro_batch_size')} x accumulation {plan.get('grad_accum')} x dp {plan.get('dp')}; "
                     f"{plan.get('tokens_per_step')} tokens per step; {plan.get('precision')}.")
        lines.append("")
    if resumes:
        lines += ["Resumed " + "; ".join(f"at step {r['step']} from `{r['checkpoint']}`" for r in resumes)
                  + " (the records an earlier run logged after a resume's step are left out).", ""]
    if unreadable:
        shown = ", ".join(map(str, unreadable[:5])) + (" ..." if len(unreadable) > 5 else "")
        lines += [f"{len(unreadable)} line(s) of `metrics.jsonl` could not be read and are left out (line {shown}: "
                  "cut short, e.g. by a killed run or a full disk).", ""]
    tok, tfl, mfu = med("tokens_per_sec"), med("tflops_per_device"), med("mfu")
    step_t, wait = med("step_time_s"), med("data_wait_max_s") or med("data_wait_s")
    table = [("steps logged", f"{len(train)} (last step {train[-1]['step']})" if train else "0"),
             ("loss", f"{train[0]['loss']:.4f} -> {train[-1]['loss']:.4f}" if train else "n/a"),
             ("validation loss (last)", f"{val[-1]['val_loss']:.4f}" if val else "no validation split"),
             ("step time (median)", f"{step_t:.3f} s" if step_t else "n/a"),
             ("tokens/s (median)", f"{tok:,.0f}" if tok else "n/a"),
             ("model TFLOP/s per device (median)", f"{tfl:.4g}" if tfl else "n/a"),
             ("MFU (median)", f"{mfu:.2%}" if mfu is not None else "n/a"),
             ("peak per device", (f"{observe['peak_tflops']:.4g} TFLOP/s ({observe.get('peak_source')})"
                                  if observe.get("peak_tflops") else observe.get("peak_source", "n/a"))),
             ("data wait (median, slowest rank)", f"{wait * 1e3:.1f} ms ({wait / step_t:.1%} of the step)"
              if wait is not None and step_t else "n/a"),
             ("resident memory (max over ranks, last step)", _mib(last.get("rss_max_bytes")) if last else "n/a")]
    lines += ["| | |", "|---|---|"] + [f"| {k} | {v} |" for k, v in table] + [""]
    lines += ["Medians skip the first logged step (start-up). MFU = model FLOPs (forward + backward, "
              "`hybridtrain/plan/flops.py`) per second per device / the device's peak.", ""]
    lines += ["## Findings", ""] + [f.markdown() for f in findings(records, plan, timeline, observe.get("gpu_total_bytes"))] + [""]
    if times is not None:
        lines += ["## Time per stage (median ms per step)", "",
                  "| stage | forward | backward | send/receive | optimizer | step |", "|---|---|---|---|---|---|"]
        for s in range(len(times["forward"])):
            lines.append(f"| {s} | " + " | ".join(f"{times[k][s] * 1e3:.1f}" for k in
                                                 ("forward", "backward", "comm", "optimizer", "step")) + " |")
        lines.append("")
    if timeline:
        lines += ["## Pipeline timeline", "",
                  f"Profiled step(s) {timeline['steps']}: measured bubble {timeline['bubble_measured']:.1%}, "
                  f"theoretical (pp-1)/(m+pp-1) = {timeline['bubble_theory']:.1%} with pp={timeline['pp']}, "
                  f"m={timeline['micro_batches']}. Chrome trace: `{files.timeline_trace.name}` (chrome://tracing or "
                  "ui.perfetto.dev).", ""]
        if files.timeline_png.is_file():
            lines += [f"![timeline]({files.timeline_png.name})", ""]
    lines += ["## Plots", ""]
    for title, path in images:
        lines += [f"### {title}", "", f"![{title}]({path.relative_to(run_dir).as_posix()})", ""]
    report = files.report_file
    report.write_text("\n".join(lines))
    return report
