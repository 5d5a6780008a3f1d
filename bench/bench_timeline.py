"""Naive model parallelism against the 1F1B pipeline, measured and drawn side by side.

    python -m bench.bench_timeline                 # A B A B, 2 rounds
    python -m bench.bench_timeline --rounds 1 --steps 4

A = naive model parallelism: pp=2 with one micro-batch per step (micro_batch_size = global batch).
B = the 1F1B pipeline: pp=2, micro_batch_size=1, so m = global batch micro-batches.
Same model, same global batch, same samples. Each run profiles its last two steps
(``trainer.profile_steps``); runs alternate A B A B so machine load hits both alike. Written to
``bench/results/``: one PNG with A's and B's last profiled step on the same time scale, and a
dated Markdown table and JSON with the median tokens/s of each (steps after the first), their
ratio, and the measured and theoretical bubbles.
"""
from __future__ import annotations

import argparse
import datetime as dt
import json
import os
import platform
import statistics
import sys
import tempfile
from pathlib import Path

from hybridtrain import cli
from hybridtrain.cli import REPO as ROOT
from hybridtrain.rundir import RunDir

MODEL = ["+recipe=gpt_tiny", "model.config.n_layer=8", "model.config.n_embd=192", "data.seq_len=128",
         "trainer.global_batch_size=8", "parallel.pp=2", "trainer.save_final=false", "trainer.report=false"]
"""A model big enough that a micro-batch's compute is not lost in the messages: 8 blocks, 192 wide."""
VARIANTS = {"naive": ["parallel.micro_batch_size=8"], "1f1b": ["parallel.micro_batch_size=1"]}


def run(name: str, steps: int, work: Path, round_: int) -> dict:
    """One training run; its timeline summary, events and steady tokens/s."""
    run_dir = work / f"{name}-{round_}"
    proc = cli.run(run_dir, [*MODEL, *VARIANTS[name], f"trainer.max_steps={steps}",
                             f"trainer.profile_steps=[{steps - 1},{steps}]"],
                   env={"HYBRIDTRAIN_CACHE": str(work / "cache")}, cwd=ROOT)
    if proc.returncode != 0:
        sys.exit(f"{' '.join(proc.args)} failed:\n{proc.stdout[-3000:]}\n{proc.stderr[-3000:]}")
    files = RunDir(run_dir)
    train = [m for m in files.metrics() if "loss" in m][1:]
    return {"dir": run_dir, "tokens_per_sec": statistics.median(m["tokens_per_sec"] for m in train),
            "step_time_s": statistics.median(m["step_time_s"] for m in train),
            "summary": files.timeline(), "events": files.timeline_spans()}


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--rounds", type=int, default=2)
    ap.add_argument("--steps", type=int, default=5)
    args = ap.parse_args()
    from hybridtrain.observe import timeline

    results: dict[str, list[dict]] = {"naive": [], "1f1b": []}
    with tempfile.TemporaryDirectory(prefix="bench_timeline_") as tmp:
        for r in range(args.rounds):
            for name in ("naive", "1f1b"):  # A B A B
                results[name].append(run(name, args.steps, Path(tmp), r))
                print(f"round {r} {name}: {results[name][-1]['tokens_per_sec']:.0f} tokens/s", flush=True)
        stamp = dt.datetime.now().strftime("%Y-%m-%d_%H%M%S")
        out = ROOT / "bench" / "results"
        out.mkdir(parents=True, exist_ok=True)
        panels = []
        for name, label in (("naive", "naive model parallelism (m=1)"), ("1f1b", "1F1B pipeline")):
            last = results[name][-1]
            step = last["summary"]["steps"][-1]
            ev = [e for e in last["events"] if e["step"] == step]
            s = last["summary"]
            panels.append((ev, f"{label}: " + timeline.step_title(step, s["pp"], s["micro_batches"],
                                                                  s["per_step"][str(step)]["bubble"])))
        png = out / f"timeline_naive_vs_1f1b_{stamp}.png"
        timeline.save_png(png, panels, share_x=True)
    table = {}
    for name, runs in results.items():
        table[name] = {"tokens_per_sec": statistics.median(x["tokens_per_sec"] for x in runs),
                       "step_time_s": statistics.median(x["step_time_s"] for x in runs),
                       "bubble_measured": statistics.median(x["summary"]["bubble_measured"] for x in runs),
                       "bubble_theory": runs[0]["summary"]["bubble_theory"],
                       "micro_batches": runs[0]["summary"]["micro_batches"],
                       "tokens_per_sec_runs": [x["tokens_per_sec"] for x in runs]}
    ratio = table["1f1b"]["tokens_per_sec"] / table["naive"]["tokens_per_sec"]
    meta = {"date": stamp, "machine": platform.processor() or platform.machine(), "cpus": os.cpu_count(),
            "rounds": args.rounds, "steps": args.steps, "model": MODEL, "variants": VARIANTS,
            "results": table, "ratio_1f1b_over_naive": ratio, "png": png.name}
    (out / f"timeline_{stamp}.json").write_text(json.dumps(meta, indent=1))
    lines = [f"# Naive model parallelism vs 1F1B ({stamp})", "",
             f"`{' '.join(MODEL)}`, {args.rounds} round(s) A B A B of {args.steps} steps; medians of steps 2..N.", "",
             "| schedule | micro-batches | tokens/s | step time | bubble measured | bubble theory |",
             "|---|---|---|---|---|---|"]
    for name, r in table.items():
        lines.append(f"| {name} | {r['micro_batches']} | {r['tokens_per_sec']:,.0f} | {r['step_time_s']:.3f} s | "
                     f"{r['bubble_measured']:.1%} | {r['bubble_theory']:.1%} |")
    lines += ["", f"1F1B / naive tokens/s: **{ratio:.2f}x**", "", f"![timelines]({png.name})", ""]
    (out / f"timeline_{stamp}.md").write_text("\n".join(lines))
    print("\n".join(lines))


if __name__ == "__main__":
    main()
