"""The pipeline timeline of profiled steps: measured bubble, Chrome trace JSON and a PNG.

An event is a dict ``{rank, stage, dp_rank, tp_rank, step, kind, micro_batch, start, end}`` with
times in seconds from the start of its step. Every rank starts a profiled step right after a
world barrier, so the clocks of all ranks share that origin (to the barrier's skew, well under a
millisecond on one node).

Bubble: over the window from the first forward to the last backward of a step, the fraction of
time a stage computes neither (waiting on a neighbour, sending, receiving, loading) averaged
over the stages. With equal stage times and free communication this is the textbook
``(pp - 1) / (m + pp - 1)`` of GPipe and 1F1B with ``m`` micro-batches.
"""
from __future__ import annotations

import json
from pathlib import Path
from typing import Any, Iterable

from hybridtrain.parallel.dims import pipeline_bubble
from hybridtrain.rundir import RunDir

COLORS = {"forward": "#4C72B0", "backward": "#55A868", "send_act": "#DD8452", "recv_act": "#F1C39E",
          "send_grad": "#C44E52", "recv_grad": "#E8A5A7", "reduce_grads": "#8172B3",
          "reduce_tied": "#B3A9D6", "optimizer": "#937860", "load": "#CCB974"}
"""Timeline colour per span kind (``hybridtrain.observe.clock.KINDS``)."""

COMPUTE = ("forward", "backward")


def representatives(events: Iterable[dict]) -> dict[int, int]:
    """Stage -> the rank drawn for it: the lowest rank of the stage (dp rank 0, tp rank 0)."""
    reps: dict[int, int] = {}
    for e in events:
        reps[e["stage"]] = min(reps.get(e["stage"], e["rank"]), e["rank"])
    return reps


def measured_bubble(step_events: list[dict]) -> tuple[float, list[float]]:
    """``(mean over stages, per stage)`` idle fraction of one step's compute window
    (first forward start to last backward end over the stages' representative ranks)."""
    reps = representatives(step_events)
    compute = [e for e in step_events if e["kind"] in COMPUTE and reps[e["stage"]] == e["rank"]]
    if not compute:
        return 0.0, []
    lo, hi = min(e["start"] for e in compute), max(e["end"] for e in compute)
    window = max(hi - lo, 1e-12)
    idle = []
    for stage in sorted(reps):
        busy = sum(e["end"] - e["start"] for e in compute if e["stage"] == stage)
        idle.append(max(0.0, 1.0 - busy / window))
    return sum(idle) / len(idle), idle


def chrome_trace(events: list[dict], step_offsets: dict[int, float], meta: dict[str, Any]) -> dict:
    """A Chrome trace (``chrome://tracing``, Perfetto): one process per stage, one thread per
    rank, a complete event (``ph: X``) per span; profiled steps follow each other at their
    offsets from the first one."""
    trace: list[dict] = []
    seen: set[tuple[int, int]] = set()
    for e in events:
        pid, tid = e["stage"], e["rank"]
        if (pid, tid) not in seen:
            seen.add((pid, tid))
            trace.append({"ph": "M", "name": "process_name", "pid": pid, "tid": tid,
                          "args": {"name": f"stage {pid}"}})
            trace.append({"ph": "M", "name": "thread_name", "pid": pid, "tid": tid,
                          "args": {"name": f"rank {tid} (dp {e['dp_rank']}, tp {e['tp_rank']})"}})
        t0 = (step_offsets.get(e["step"], 0.0) + e["start"]) * 1e6
        trace.append({"ph": "X", "name": f"{e['kind']} {e['micro_batch']}", "cat": e["kind"], "pid": pid, "tid": tid,
                      "ts": t0, "dur": max(0.0, (e["end"] - e["start"]) * 1e6),
                      "args": {"step": e["step"], "micro_batch": e["micro_batch"]}})
    return {"traceEvents": trace, "displayTimeUnit": "ms", "otherData": meta}


def draw_step(ax, step_events: list[dict], title: str) -> None:
    """Draw one step on ``ax``: a row per stage (its representative rank), boxes per span labelled
    with the micro-batch number, blank where the stage idles."""
    reps = representatives(step_events)
    stages = sorted(reps)
    for stage in stages:
        y = len(stages) - 1 - stage  # stage 0 on top, like the 1F1B diagrams
        ax.broken_barh([(0, 1e9)], (y - 0.4, 0.8), facecolors="#F4F4F4", zorder=0)
        for e in step_events:
            if e["rank"] != reps[stage]:
                continue
            width = (e["end"] - e["start"]) * 1e3
            big = e["kind"] in COMPUTE
            h = 0.8 if big else 0.3
            ax.broken_barh([(e["start"] * 1e3, width)], (y - h / 2, h), facecolors=COLORS.get(e["kind"], "#999999"),
                           edgecolors="white" if big else "none", linewidth=0.5, zorder=2 if big else 1)
            if big:
                ax.text(e["start"] * 1e3 + width / 2, y, str(e["micro_batch"]), ha="center", va="center",
                        fontsize=7, color="white", zorder=3, clip_on=True)
    ends = [e["end"] for e in step_events] or [1.0]
    ax.set_xlim(0, max(ends) * 1e3 * 1.01)
    ax.set_ylim(-0.6, len(stages) - 0.4)
    ax.set_yticks(range(len(stages)))
    ax.set_yticklabels([f"stage {s}" for s in reversed(stages)])
    ax.set_xlabel("ms since the step started")
    ax.set_title(title, fontsize=9)


def legend(fig, kinds: Iterable[str]) -> None:
    """A legend of the span kinds that occur."""
    from matplotlib.patches import Patch

    names = {"forward": "forward", "backward": "backward", "send_act": "send activation",
             "recv_act": "receive activation", "send_grad": "send gradient", "recv_grad": "receive gradient",
             "reduce_grads": "dp gradient reduce", "reduce_tied": "tied gradient reduce",
             "optimizer": "optimizer step", "load": "load micro-batch"}
    present = [k for k in COLORS if k in set(kinds)]
    fig.legend(handles=[Patch(color=COLORS[k], label=names[k]) for k in present], loc="lower center",
               ncol=min(5, len(present)), fontsize=7, frameon=False)


def step_title(step: int, pp: int, m: int, measured: float) -> str:
    """The caption of a step: measured against theoretical bubble."""
    return (f"step {step}: pp={pp}, {m} micro-batch(es); bubble measured {measured:.0%}, "
            f"theory (pp-1)/(m+pp-1) = {pipeline_bubble(pp, m):.0%}")


def save_png(path: Path, panels: list[tuple[list[dict], str]], share_x: bool = False) -> None:
    """One PNG with a panel per ``(step_events, title)``, stacked vertically; ``share_x`` puts every
    panel on the same time scale (to compare two schedules)."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    rows = max(len(representatives(ev)) for ev, _ in panels)
    fig, axes = plt.subplots(len(panels), 1, figsize=(11, 0.9 + len(panels) * (0.55 * rows + 1.0)), squeeze=False)
    for ax, (ev, title) in zip(axes[:, 0], panels):
        draw_step(ax, ev, title)
    if share_x:
        right = max(ax.get_xlim()[1] for ax in axes[:, 0])
        for ax in axes[:, 0]:
            ax.set_xlim(0, right)
    legend(fig, {e["kind"] for ev, _ in panels for e in ev})
    fig.tight_layout(rect=(0, 0.06, 1, 1))
    fig.savefig(path, dpi=120)
    plt.close(fig)


def write(run_dir: Path, events: list[dict], step_offsets: dict[int, float], pp: int, micro_batches: int) -> dict:
    """Write ``timeline.png``, ``timeline_trace.json`` and ``timeline_summary.json`` into ``run_dir``;
    return the summary (measured bubble per step and mean, theoretical bubble)."""
    files = RunDir(run_dir)
    steps = sorted({e["step"] for e in events})
    per_step = {}
    panels = []
    for s in steps:
        ev = [e for e in events if e["step"] == s]
        mean, idle = measured_bubble(ev)
        per_step[str(s)] = {"bubble": mean, "stage_idle": idle}
        panels.append((ev, step_title(s, pp, micro_batches, mean)))
    summary = {"pp": pp, "micro_batches": micro_batches, "steps": steps,
               "bubble_theory": pipeline_bubble(pp, micro_batches),
               "bubble_measured": sum(v["bubble"] for v in per_step.values()) / max(1, len(per_step)),
               "per_step": per_step,
               "files": {"png": files.timeline_png.name, "trace": files.timeline_trace.name}}
    files.timeline_trace.write_text(json.dumps(chrome_trace(events, step_offsets, summary)))
    files.timeline_events.write_text(json.dumps(events))
    files.timeline_summary.write_text(json.dumps(summary, indent=1))
    if panels:
        save_png(files.timeline_png, panels)
    return summary
