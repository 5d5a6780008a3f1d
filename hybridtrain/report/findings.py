"""Findings of a run as data: what the numbers say and the concrete change to try.

Pure functions of the ``metrics.jsonl`` records, ``plan.json`` and the timeline summary, so they
are unit-tested without a run. Thresholds are deliberately coarse: a finding is a lead to
measure, not a verdict.
"""
from __future__ import annotations

from dataclasses import dataclass
from statistics import median
from typing import Any

from hybridtrain.parallel.dims import pipeline_bubble

STAGE_IMBALANCE = 0.15
"""A stage whose forward + backward time exceeds the stages' mean by this fraction is reported."""
BUBBLE = 0.25
"""A measured (or, without a timeline, theoretical) bubble above this is reported."""
DATA_WAIT = 0.05
"""Data wait above this share of the step time is reported."""
COMM = 0.25
"""Pipeline send/receive time above this share of a stage's step time is reported."""
GPU_MEMORY_HIGH = 0.90
"""GPU peak allocation above this share of device memory is reported (when the total is known)."""


@dataclass
class Finding:
    """One observation and what to change."""

    title: str
    detail: str
    suggestion: str

    def markdown(self) -> str:
        """A Markdown list item."""
        return f"- **{self.title}.** {self.detail} Suggestion: {self.suggestion}"


def train_records(records: list[dict]) -> list[dict]:
    """The training-step records (not the validation ones)."""
    return [r for r in records if "loss" in r]


def steady(records: list[dict]) -> list[dict]:
    """Training records without the first logged step (start-up, allocator warm-up) when there are more."""
    rows = train_records(records)
    return rows[1:] if len(rows) > 1 else rows


def _median_list(rows: list[dict], key: str) -> list[float] | None:
    lists = [r[key] for r in rows if isinstance(r.get(key), list)]
    if not lists:
        return None
    return [median(v[i] for v in lists) for i in range(len(lists[0]))]


def stage_times(records: list[dict]) -> dict[str, list[float]] | None:
    """Median per-stage ``forward``, ``backward``, ``comm``, ``optimizer`` and ``step`` seconds over
    the steady steps, or ``None`` when the run has no stage times."""
    rows = steady(records)
    out = {}
    for name, key in (("forward", "stage_forward_s"), ("backward", "stage_backward_s"), ("comm", "stage_comm_s"),
                      ("optimizer", "stage_optimizer_s"), ("step", "stage_step_time_s")):
        vals = _median_list(rows, key)
        if vals is None:
            return None
        out[name] = vals
    return out


def _partition_suggestion(plan: dict[str, Any], slow: int, fast: int) -> str:
    """The change to try when stage ``slow`` is the bottleneck, from ``plan.json``'s ``partition_method``
    and stage boundaries (:func:`~hybridtrain.plan.partition.partition_advice`)."""
    from hybridtrain.plan.partition import partition_advice

    how = partition_advice(plan.get("partition_method") or "", plan.get("stage_bounds") or [], measured=True)
    return f"move pipeline layers from stage {slow} towards stage {fast}: {how}, then compare the stage times of the two runs."


def findings(records: list[dict], plan: dict[str, Any], timeline: dict[str, Any] | None = None,
             gpu_total_bytes: int | None = None) -> list[Finding]:
    """Every finding for a run, most important first."""
    out: list[Finding] = []
    rows = steady(records)
    if not rows:
        return [Finding("No training steps logged", "metrics.jsonl holds no training record.",
                        "check the worker output for an error before the first step.")]
    step_time = median(r["step_time_s"] for r in rows)
    pp, m = int(plan.get("pp", 1)), int(plan.get("grad_accum", 1))

    losses = [r["loss"] for r in train_records(records)]
    if any(x != x or x in (float("inf"), float("-inf")) for x in losses):
        out.append(Finding("Loss is not finite", "a training loss is NaN or infinite.",
                           "lower optim.lr, keep optim.grad_clip > 0, or use trainer.precision=fp32/bf16 instead of fp16."))
    elif len(losses) >= 4 and losses[-1] >= losses[0]:
        out.append(Finding("Loss did not fall", f"the loss went from {losses[0]:.4f} to {losses[-1]:.4f}.",
                           "check optim.lr and optim.warmup_steps; for a short run this may be noise."))

    st = stage_times(records)
    if st is not None and pp > 1:
        compute = [f + b for f, b in zip(st["forward"], st["backward"])]
        mean = sum(compute) / len(compute)
        slow = max(range(pp), key=lambda s: compute[s])
        fast = min(range(pp), key=lambda s: compute[s])
        if mean > 0 and compute[slow] > (1 + STAGE_IMBALANCE) * mean:
            out.append(Finding(
                f"Stage {slow} is the slowest",
                f"its forward + backward takes {compute[slow] * 1e3:.1f} ms per step, "
                f"{compute[slow] / mean - 1:.0%} above the stages' mean ({mean * 1e3:.1f} ms); stage {fast} takes "
                f"{compute[fast] * 1e3:.1f} ms. Every other stage waits for it.",
                _partition_suggestion(plan, slow, fast)))
        comm_share = [c / s if s > 0 else 0.0 for c, s in zip(st["comm"], st["step"])]
        worst = max(range(pp), key=lambda s: comm_share[s])
        if comm_share[worst] > COMM:
            out.append(Finding(
                "Much time in pipeline send/receive",
                f"stage {worst} spends {comm_share[worst]:.0%} of its step blocked in send/receive "
                "(this includes waiting for a slower neighbour).",
                "balance the stages first (above); then fewer stages (parallel.pp) with more data parallelism, "
                "or more micro-batches so each transfer overlaps more work."))

    if pp > 1:
        theory = pipeline_bubble(pp, m)
        measured = timeline.get("bubble_measured") if timeline else None
        bubble = measured if measured is not None else theory
        if bubble > BUBBLE:
            what = (f"measured {measured:.0%} (theory {theory:.0%})" if measured is not None
                    else f"theory (pp-1)/(m+pp-1) = {theory:.0%}")
            target = 4 * pp
            if m < target:
                advice = (f"more micro-batches: m = trainer.global_batch_size / (parallel.micro_batch_size x dp); "
                          f"m={target} gives a theoretical bubble of {pipeline_bubble(pp, target):.0%}. Lower "
                          "parallel.micro_batch_size or raise trainer.global_batch_size.")
            else:  # enough micro-batches: the idle time comes from unequal stages or slow transfers
                advice = ("m is already large, so the idle time comes from unequal stages or slow send/receive "
                          "(see the stage times): balance the partition first; with micro-batches this small, "
                          "a larger parallel.micro_batch_size (fewer, bigger transfers) may help.")
            out.append(Finding(
                "Large pipeline bubble",
                f"with pp={pp} and m={m} micro-batch(es) per step the stages idle a large share of the step: {what}.",
                advice))

    waits = [r.get("data_wait_max_s", r.get("data_wait_s")) for r in rows]
    waits = [w for w in waits if w is not None]
    if waits and step_time > 0 and median(waits) / step_time > DATA_WAIT:
        share = median(waits) / step_time
        out.append(Finding(
            "High data wait",
            f"the slowest rank waits {share:.0%} of the step for its micro-batches.",
            "the samples are read from memory-mapped .npy files in the training process: put the cache "
            "(data.cache_dir) on a local disk, give each rank more CPU threads (launcher.threads_per_rank) or "
            "fewer ranks per node, and check that the data was tokenized once (the launcher says 'cached')."))

    peaks = _median_list(rows, "rank_gpu_peak_bytes")
    if peaks and gpu_total_bytes:
        top = max(p for p in peaks if p is not None)
        if top / gpu_total_bytes > GPU_MEMORY_HIGH:
            out.append(Finding(
                "GPU memory nearly full", f"a rank's peak allocation is {top / gpu_total_bytes:.0%} of the device.",
                "enable parallel.activation_checkpointing, lower parallel.micro_batch_size, or raise parallel.tp/pp."))

    mfus = [r["mfu"] for r in rows if r.get("mfu") is not None]
    if mfus:
        mfu = median(mfus)
        if mfu > 1.0:
            out.append(Finding("MFU above 100%", f"median MFU is {mfu:.0%}, above the device's peak.",
                               "the peak is wrong: set trainer.peak_tflops to your device's dense peak (on a CPU, "
                               "the cached matmul probe in peak_tflops.json ran slower than the cores can: "
                               "delete its entry and rerun on a quiet machine)."))
    if not out:
        out.append(Finding("Nothing stands out", "no stage imbalance, bubble, data wait or memory pressure above "
                           "the report's thresholds.", "raise parallel.micro_batch_size while memory allows, "
                           "for higher MFU."))
    return out
