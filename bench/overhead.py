"""The overhead comparison: hybridtrain (1,1,1) against the plain transformers + AdamW loop and the
HF ``Trainer``, one process each, same model, data, batch, micro-batches, threads and precision, and
against the plain loop with hybridtrain's ``malloc`` setting (:data:`SIDES`).

The step time of every side is the wall time of a whole loop iteration: for hybridtrain the
difference of consecutive ``elapsed_s`` in ``metrics.jsonl`` (the step plus its observation,
metrics line and progress bar), for the plain loop ``step_time_s`` of
:func:`hybridtrain.reference.reference_run` (its loop has nothing else per step), for the
``Trainer`` the time between its ``on_step_end`` callbacks (its logging included).
"""
from __future__ import annotations

import os
import statistics
from pathlib import Path

from bench.baselines import run_baseline
from bench.common import check, median_of, run_hybridtrain
from bench.models import MODELS, BenchModel, quick_steps

SIDES = {"hybridtrain": "A: hybridtrain (1,1,1)", "plain": "B: plain transformers + AdamW loop",
         "trainer": "C: HF Trainer", "plain_keep": "D: B with hybridtrain's malloc setting"}
"""B and C run as a user runs them; D is B with ``launcher.keep_host_memory``'s ``malloc`` setting, so
A / D is hybridtrain's own cost alone and D / B what the setting gains."""


def loop_times(records: list[dict], skip: int) -> list[float]:
    """Wall seconds of each loop iteration after the first ``skip`` steps, from the ``elapsed_s`` of
    consecutive metrics records (every step must be logged: ``trainer.log_every=1``)."""
    train = [r for r in records if "elapsed_s" in r]
    return [b["elapsed_s"] - a["elapsed_s"] for a, b in zip(train, train[1:]) if b["step"] > skip]


def _median(times: list[float]) -> float:
    if not times:
        raise RuntimeError("no measured step: more steps than warm-up steps are needed")
    return statistics.median(times)


def overhead(work: Path, rounds: int, quick: bool, done: dict, alternate, model: str | None = None) -> dict:
    """hybridtrain (1,1,1) against the plain loop and the HF Trainer on the bench model ``model``
    (default: the suite's model), all cores."""
    name = model or ("gpt_tiny" if quick else "gpt_192")
    bm: BenchModel = MODELS[name]
    steps, skip = quick_steps(bm) if quick and model else (bm.steps, bm.skip)
    threads = os.cpu_count() or 1
    overrides = bm.overrides + ["parallel.dp=1", "parallel.tp=1", "parallel.pp=1",
                                f"launcher.threads_per_rank={threads}", f"trainer.max_steps={steps}",
                                "trainer.log_every=1"]

    def ht(r: int) -> dict:
        run = check(run_hybridtrain(work / f"ht_{name}_{r}", overrides))
        records = run.metrics()
        if model is None:
            done[(1, 1, 1)] = {"measured": records[-1]["model_state_bytes"], "run_dir": run.run_dir}
        return _result(loop_times(records, skip), bm)

    def baseline(kind: str):
        return lambda r: _result([x["step_time_s"] for x in run_baseline(kind, overrides, threads) if x["step"] > skip], bm)

    res = alternate({k: ht if k == "hybridtrain" else baseline(k) for k in SIDES}, rounds)
    tps = {k: bm.tokens_per_step / median_of(v, "step_s") for k, v in res.items()}
    ratios = {k: tps["hybridtrain"] / tps[k] for k in ("plain", "trainer", "plain_keep")}
    rows = [["side", "median step s", "tokens/s", "runs (median step s)"]]
    rows += [[SIDES[k], f"{median_of(v, 'step_s'):.4f}", f"{tps[k]:,.1f}", ", ".join(f"{x['step_s']:.4f}" for x in v)]
             for k, v in res.items()]
    target = {k: bm.targets.get(k) for k in ratios}
    summary = "; ".join(f"hybridtrain / {k}: **{ratios[k]:.3f}x**" + (f" (target >= {target[k]})" if target[k] else "")
                        for k in ratios)
    return {
        "title": f"Overhead on {name}: hybridtrain (1,1,1) vs the plain loop and the HF Trainer",
        "what": (f"`{' '.join(bm.overrides)}`. One process per side, {threads} threads each, the same model and "
                 f"initial weights, global batches of {bm.tokens_per_step} tokens (8 micro-batches of 1 "
                 f"accumulated), schedule and precision (fp32); {steps} steps per run, the median wall time of a "
                 f"loop iteration after {skip} warm-up steps (`bench/overhead.py`: hybridtrain from "
                 "consecutive `elapsed_s` of metrics.jsonl, plain from `hybridtrain.reference.reference_run`, "
                 "the Trainer between its `on_step_end` callbacks; `bench/baselines.py`). Each side in a fresh process; "
                 "D is the plain loop with the `malloc` setting of hybridtrain's CPU ranks (`launcher.keep_host_memory`): "
                 "A / D is hybridtrain's own cost, D / B what the setting gains."),
        "table": rows, "summary": summary + ".", "ratio": ratios["plain"], "ratios": ratios, "targets": target,
        "model": name, "raw": res,
        "plot": {"labels": list(res), "values": [tps[k] for k in res], "ylabel": "tokens/s"},
    }


def _result(times: list[float], bm: BenchModel) -> dict:
    step = _median(times)
    return {"step_s": step, "tokens_per_s": bm.tokens_per_step / step, "steps_s": times}
