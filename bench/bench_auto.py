"""Cost-model benchmark: does ``parallel=auto`` rank layouts the way they really run?

    python -m bench.bench_auto [--steps 8] [--rounds 1]

Every (dp, tp, pp) layout of world size 4 for a small GPT-2 (4 blocks, width 96, 4 heads so that
tp = 4 divides them; micro-batch 1, ZeRO-1, fp32) is trained for real through
``python -m hybridtrain`` with one thread per rank, layouts alternating A B C ... per round. The
measured throughput of a layout is the median tokens/s of its steps after the first two (warm-up),
the median over rounds. The cost model (:mod:`hybridtrain.plan.auto`, calibrated on this machine)
estimates the same layouts; the Spearman rank correlation of predicted and measured tokens/s is the
result (target >= 0.8). Writes ``bench/results/auto-<date>.md`` and ``.json`` with the load average
before and after, since a shared machine distorts the measurement.
"""
from __future__ import annotations

import argparse
import datetime as dt
import json
import os
import statistics
import tempfile
from pathlib import Path

from hybridtrain import cli
from hybridtrain.cli import REPO as ROOT
from hybridtrain.models.families import get_family
from hybridtrain.rundir import RunDir

MODEL = ["+recipe=gpt_tiny", "model.config.n_head=4", "parallel.micro_batch_size=1", "parallel.zero_stage=1",
         "trainer.global_batch_size=8", "launcher.threads_per_rank=1", "trainer.save_final=false",
         "optim.warmup_steps=1"]
WORLD = 4


def layouts(world: int) -> list[tuple[int, int, int]]:
    return [(dp, tp, world // (dp * tp)) for dp in range(1, world + 1) for tp in range(1, world + 1)
            if world % (dp * tp) == 0]


def spearman(a: list[float], b: list[float]) -> float:
    """Spearman's rho (average ranks for ties)."""
    def ranks(x):
        order = sorted(range(len(x)), key=lambda i: x[i])
        r = [0.0] * len(x)
        i = 0
        while i < len(order):
            j = i
            while j + 1 < len(order) and x[order[j + 1]] == x[order[i]]:
                j += 1
            for k in range(i, j + 1):
                r[order[k]] = (i + j) / 2
            i = j + 1
        return r

    ra, rb = ranks(a), ranks(b)
    ma, mb = statistics.mean(ra), statistics.mean(rb)
    cov = sum((x - ma) * (y - mb) for x, y in zip(ra, rb))
    var = (sum((x - ma) ** 2 for x in ra) * sum((y - mb) ** 2 for y in rb)) ** 0.5
    return cov / var if var else 0.0


def measure(layout, steps: int, work: Path) -> float:
    """Median tokens/s of one real run of ``layout`` (steps after the first two)."""
    dp, tp, pp = layout
    run_dir = work / f"run_{dp}{tp}{pp}_{len(list(work.iterdir()))}"
    proc = cli.run(run_dir, [*MODEL, f"parallel.dp={dp}", f"parallel.tp={tp}", f"parallel.pp={pp}",
                             f"trainer.max_steps={steps}"], cwd=ROOT)
    if proc.returncode:
        raise SystemExit(f"{' '.join(proc.args)} failed:\n{proc.stdout[-3000:]}\n{proc.stderr[-3000:]}")
    rows = RunDir(run_dir).metrics()
    return statistics.median(r["tokens_per_sec"] for r in rows if "tokens_per_sec" in r and r["step"] > 2)


def predict(layout) -> tuple[float, dict]:
    """The cost model's tokens/s for ``layout`` (same config as the runs)."""
    from hybridtrain.plan import build_plan, machine_facts, model_config
    from hybridtrain.plan.auto import Candidate, estimate
    from hybridtrain.plan.calibrate import rates
    from hybridtrain.plan.costs import model_facts

    cfg = cli.compose(MODEL + [f"launcher.gpus_per_node={WORLD}"])
    hf = model_config(cfg)
    machine = machine_facts()
    r = rates(1, True, (cfg.data.seq_len, int(hf.n_embd)), WORLD)
    dp, tp, pp = layout
    facts = model_facts(get_family("gpt2"), hf, cfg.data.seq_len, tp)
    candidate = Candidate(dp, tp, pp, 1, 1, False)
    trial = candidate.config(cfg)
    plan = build_plan(trial, hf, machine, int(hf.vocab_size))
    c = estimate(candidate, plan, facts, trial, r, WORLD, machine.cpu_cores)
    return cfg.trainer.global_batch_size * cfg.data.seq_len / c.step_time, r.__dict__


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--steps", type=int, default=8)
    parser.add_argument("--rounds", type=int, default=1)
    parser.add_argument("--out", type=Path, default=ROOT / "bench" / "results")
    args = parser.parse_args()
    from bench.bench_data import machine

    lays = layouts(WORLD)
    load_before = os.getloadavg()
    measured: dict = {lay: [] for lay in lays}
    with tempfile.TemporaryDirectory() as tmp:
        for _ in range(args.rounds):
            for lay in lays:  # A B C D E F per round
                measured[lay].append(measure(lay, args.steps, Path(tmp)))
                print(f"{lay}: {measured[lay][-1]:.0f} tokens/s", flush=True)
    load_after = os.getloadavg()
    preds = {lay: predict(lay) for lay in lays}
    meas = [statistics.median(measured[lay]) for lay in lays]
    pred = [preds[lay][0] for lay in lays]
    rho = spearman(pred, meas)
    stamp = dt.datetime.now().strftime("%Y-%m-%d_%H%M%S")
    record = {"date": stamp, "machine": machine(), "loadavg_before": load_before, "loadavg_after": load_after,
              "model": MODEL, "world": WORLD, "steps": args.steps, "rounds": args.rounds,
              "rates": preds[lays[0]][1], "spearman": rho,
              "layouts": [{"dp": l[0], "tp": l[1], "pp": l[2], "measured_tokens_per_s": measured[l],
                           "predicted_tokens_per_s": preds[l][0]} for l in lays]}
    args.out.mkdir(parents=True, exist_ok=True)
    (args.out / f"auto-{stamp}.json").write_text(json.dumps(record, indent=1))
    lines = [f"# Cost-model ranking benchmark {stamp}", "",
             f"Machine: {record['machine']}; load average before {load_before[0]:.2f}, after {load_after[0]:.2f} "
             "(a shared machine distorts the measurement; rerun on a quiet one). "
             f"Model: `{' '.join(MODEL)}`, world size {WORLD}, {args.steps} steps per run, {args.rounds} round(s).", "",
             "| dp | tp | pp | measured tokens/s | predicted tokens/s | measured rank | predicted rank |",
             "|---|---|---|---|---|---|---|"]
    mrank = {l: i for i, l in enumerate(sorted(lays, key=lambda l: -meas[lays.index(l)]), 1)}
    prank = {l: i for i, l in enumerate(sorted(lays, key=lambda l: -pred[lays.index(l)]), 1)}
    for l, m, p in zip(lays, meas, pred):
        lines.append(f"| {l[0]} | {l[1]} | {l[2]} | {m:.0f} | {p:.0f} | {mrank[l]} | {prank[l]} |")
    lines += ["", f"Spearman rank correlation: **{rho:.2f}** (target >= 0.8)"]
    (args.out / f"auto-{stamp}.md").write_text("\n".join(lines) + "\n")
    print("\n".join(lines))


if __name__ == "__main__":
    main()
