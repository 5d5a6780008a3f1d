"""The comparisons of ``bench/run.py``. Each takes (work folder, rounds, quick, runs so far,
``alternate``) and returns a section: ``title``, ``what`` (how it was measured), ``table`` (header
row, then rows), ``summary`` (the ratio line), ``plot`` (bar data) and the raw numbers."""
from __future__ import annotations

import json
import os
import subprocess
import sys
import threading
import time
from pathlib import Path

from bench.common import ROOT, check, median_of, run_hybridtrain, steady_step_time, tree_cpu
from bench.overhead import overhead
from hybridtrain import cli
from hybridtrain.rundir import RunDir

# The benchmark model. Full: gpt_tiny widened to 192 so that compute, not per-step bookkeeping, is
# most of a step (4 layers, 6 heads, MLP 768, vocab 8000, 3.4M parameters), 8 sequences a step.
# Quick: gpt_tiny itself (96 wide, 1.2M parameters), 8 x 32 tokens, so a busy 2-core machine gets
# through every comparison; its per-step bookkeeping weighs more, which makes ratios harsher.
MODEL = ["+recipe=gpt_tiny", "model.config.n_embd=192", "data.seq_len=128", "trainer.global_batch_size=8",
         "optim.warmup_steps=2", "trainer.save_final=false"]
QUICK_MODEL = ["+recipe=gpt_tiny", "data.seq_len=32", "trainer.global_batch_size=8", "optim.warmup_steps=2",
               "trainer.save_final=false"]
SKIP = 3  # warm-up steps left out of the step time


def _model(quick: bool) -> list[str]:
    return QUICK_MODEL if quick else MODEL


def _tokens(quick: bool) -> int:
    return 8 * (32 if quick else 128)


def _steps(quick: bool) -> int:
    return 8 if quick else 30


def _layout(dp: int, tp: int, pp: int, micro: int = 1, threads: int | None = None) -> list[str]:
    out = [f"parallel.dp={dp}", f"parallel.tp={tp}", f"parallel.pp={pp}", f"parallel.micro_batch_size={micro}"]
    return out + ([f"launcher.threads_per_rank={threads}"] if threads else [])


def _train(work: Path, name: str, r: int, quick: bool, overrides: list[str], done: dict, key: tuple | None = None,
           env: dict | None = None, inject: bool = False) -> dict:
    run = check(run_hybridtrain(work / f"{name}_{r}", _model(quick) + overrides, env=env, inject=inject))
    records = run.metrics()
    if key is not None:
        done[key] = {"measured": records[-1]["model_state_bytes"], "run_dir": run.run_dir}  # peaks after the steps
    step = steady_step_time(records, SKIP)
    return {"step_s": step, "tokens_per_s": _tokens(quick) / step, "run_dir": str(run.run_dir)}


def _row(label: str, results: list[dict], quick: bool, key: str = "step_s") -> list[str]:
    med = median_of(results, key)
    return [label, f"{med:.4f}", f"{_tokens(quick) / med:,.0f}", ", ".join(f"{x[key]:.4f}" for x in results)]


HEADER = ["side", "median step s", "tokens/s", "runs (step s)"]


def _stage_flops(run_dir: str) -> list[float]:
    """Forward FLOPs per token of each pipeline stage of a run (plan.json + hybridtrain.plan.flops)."""
    from hybridtrain.models.families import family_of
    from hybridtrain.plan import model_config
    from hybridtrain.models.shapes import block_shapes
    from hybridtrain.models.units import model_units
    from hybridtrain.plan.flops import unit_forward_flops

    files = RunDir(run_dir)
    cfg, plan = files.config(), files.plan_record()
    hf, family = model_config(cfg), family_of(cfg.model)
    units, bounds = model_units(family, hf), plan["stage_bounds"]
    linear = block_shapes(family, hf).linear_flops
    return [sum(unit_forward_flops(u, family, hf, plan["seq_len"], plan["padded_vocab_size"], linear.get(u.variant, 0.0))
                for u in units[bounds[s]:bounds[s + 1]]) for s in range(len(bounds) - 1)]


def pipeline(work: Path, rounds: int, quick: bool, done: dict, alternate) -> dict:
    """pp=2 with 8 micro-batches of 1 (1F1B) against pp=2 with one micro-batch of 8 (naive)."""
    steps = [f"trainer.max_steps={_steps(quick)}"]
    res = alternate({"pipelined": lambda r: _train(work, "pp_m8", r, quick, _layout(1, 1, 2, 1, 1) + steps, done, (1, 1, 2)),
                     "naive": lambda r: _train(work, "pp_m1", r, quick, _layout(1, 1, 2, 8, 1) + steps, done)}, rounds)
    speedup = median_of(res["naive"], "step_s") / median_of(res["pipelined"], "step_s")
    m, pp = 8, 2
    flops = _stage_flops(res["pipelined"][0]["run_dir"])
    theory_even = pp * m / (m + pp - 1)
    theory = m * sum(flops) / ((m + pp - 1) * max(flops))
    return {
        "title": "Pipeline vs naive model parallelism: pp=2, 8 micro-batches vs 1",
        "what": ("Two processes, one thread each, the same global batch of 8 sequences. Pipelined: micro-batch 1, "
                 "8 micro-batches in DeepSpeed's 1F1B schedule. Naive: micro-batch 8, one micro-batch, so the stages "
                 "take turns. Theory: naive time = m x sum of the stages' per-sample time, pipelined = "
                 "(m + pp - 1) x the slowest stage's per-sample time, with the stages' model FLOPs "
                 f"(hybridtrain.plan.flops) standing for their times: {', '.join(f'{f / 1e6:.1f}' for f in flops)} "
                 f"MFLOP/token. Equal stages would give pp x m / (m + pp - 1) = {theory_even:.2f}x. The theory assumes a "
                 "sample costs the same in a micro-batch of 1 as of 8; on a CPU larger matrices run faster per "
                 "sample, which the naive side gains."),
        "table": [HEADER, _row("A: pp=2, 8 micro-batches (1F1B)", res["pipelined"], quick),
                  _row("B: pp=2, 1 micro-batch (naive)", res["naive"], quick)],
        "summary": f"Speed-up of pipelining: measured **{speedup:.2f}x**, theoretical {theory:.2f}x "
                   f"(stage FLOPs) / {theory_even:.2f}x (equal stages).",
        "ratio": speedup, "theory": theory, "theory_equal_stages": theory_even, "stage_flops": flops, "raw": res,
        "plot": {"labels": ["pipelined m=8", "naive m=1"],
                 "values": [_tokens(quick) / median_of(res[k], "step_s") for k in ("pipelined", "naive")], "ylabel": "tokens/s"},
    }


def dp(work: Path, rounds: int, quick: bool, done: dict, alternate) -> dict:
    """dp=2 against dp=1, one thread per process, the same global batch."""
    steps = [f"trainer.max_steps={_steps(quick)}"]
    res = alternate({"dp2": lambda r: _train(work, "dp2", r, quick, _layout(2, 1, 1, 1, 1) + steps, done, (2, 1, 1)),
                     "dp1": lambda r: _train(work, "dp1", r, quick, _layout(1, 1, 1, 1, 1) + steps, done)}, rounds)
    speedup = median_of(res["dp1"], "step_s") / median_of(res["dp2"], "step_s")
    return {
        "title": "Data parallel scaling: dp=2 vs dp=1",
        "what": ("One thread per process, ZeRO-1, the same global batch of 8 sequences (dp=1: 8 micro-batches "
                 "accumulated; dp=2: 4 per replica, gradients all-reduced once per step). Ideal: 2x."),
        "table": [HEADER, _row("A: dp=2 (2 processes)", res["dp2"], quick), _row("B: dp=1 (1 process)", res["dp1"], quick)],
        "summary": f"Speed-up **{speedup:.2f}x** of the ideal 2x (scaling efficiency {speedup / 2:.0%}).",
        "ratio": speedup, "target": 2.0, "raw": res,
        "plot": {"labels": ["dp=2", "dp=1"], "values": [_tokens(quick) / median_of(res[k], "step_s") for k in ("dp2", "dp1")],
                 "ylabel": "tokens/s"},
    }


def tp(work: Path, rounds: int, quick: bool, done: dict, alternate) -> dict:
    """tp=2 against tp=1; the all-reduce share from a tp=2 run whose all-reduces are no-ops."""
    steps = [f"trainer.max_steps={_steps(quick)}"]
    no_comm = {"HT_BENCH_NO_ALLREDUCE": "1"}
    res = alternate({
        "tp2": lambda r: _train(work, "tp2", r, quick, _layout(1, 2, 1, 1, 1) + steps, done, (1, 2, 1)),
        "tp1": lambda r: _train(work, "tp1", r, quick, _layout(1, 1, 1, 1, 1) + steps, done),
        "tp2_no_allreduce": lambda r: _train(work, "tp2nc", r, quick, _layout(1, 2, 1, 1, 1) + steps, done, env=no_comm,
                                             inject=True),
    }, rounds)
    t1, t2, tnc = (median_of(res[k], "step_s") for k in ("tp1", "tp2", "tp2_no_allreduce"))
    share = max(0.0, 1 - tnc / t2)
    return {
        "title": "Tensor parallel cost: tp=2 vs tp=1, and the share of time in all-reduce",
        "what": ("One thread per process, the same global batch. The communication share is measured by "
                 "subtraction: C is the same tp=2 run with `torch.distributed.all_reduce` replaced by a no-op "
                 "(bench/inject/sitecustomize.py; the Megatron f/g all-reduces, the vocabulary-parallel loss and the "
                 "gradient-norm reduction all go through it), so C does the same compute on the same shapes without "
                 "the all-reduces; share = 1 - C / B. It includes the time a rank waits for its slower peer. Run "
                 "A B C A B C ..."),
        "table": [HEADER, _row("A: tp=1 (1 process)", res["tp1"], quick), _row("B: tp=2 (2 processes)", res["tp2"], quick),
                  _row("C: tp=2, all-reduce replaced by a no-op", res["tp2_no_allreduce"], quick)],
        "summary": (f"tp=2 speed-up over tp=1: **{t1 / t2:.2f}x** (ideal 2x); all-reduce share of the tp=2 step: "
                    f"**{share:.0%}** ({t2 - tnc:.4f} s of {t2:.4f} s); without it tp=2 would be {t1 / tnc:.2f}x."),
        "ratio": t1 / t2, "comm_share": share, "raw": res,
        "plot": {"labels": ["tp=1", "tp=2", "tp=2 no all-reduce"], "values": [_tokens(quick) / t for t in (t1, t2, tnc)],
                 "ylabel": "tokens/s"},
    }


def _all_layouts() -> list[tuple[int, int, int]]:
    """(dp, tp, pp) with world <= 8 that the benchmark model allows (tp | 6 heads, pp <= 4 layers,
    dp | the global batch 8)."""
    return sorted(((d, t, p) for d in (1, 2, 4, 8) for t in (1, 2, 3, 6) for p in (1, 2, 3, 4) if d * t * p <= 8),
                  key=lambda x: (x[0] * x[1] * x[2], x))


QUICK_LAYOUTS = [(1, 1, 1), (2, 1, 1), (1, 2, 1), (1, 1, 2), (1, 2, 2), (2, 2, 2)]


def memory(work: Path, rounds: int, quick: bool, done: dict, alternate) -> dict:
    """Model-state bytes of rank 0 for every layout up to 8 ranks: measured by the worker, estimated
    by the plan command's memory model, and the ideal split."""
    from hybridtrain.plan.estimate import estimate_for_run

    layouts = QUICK_LAYOUTS if quick else _all_layouts()
    for layout in layouts:
        if layout not in done:
            d, t, p = layout
            _train(work, f"mem_{d}{t}{p}", 0, quick, _layout(d, t, p, 1, 1) + [f"trainer.max_steps={SKIP + 1}"], done, layout)
    total = done[(1, 1, 1)]["measured"]["total"]
    rows = [["dp x tp x pp", "world", "rank 0 model state (measured)", "params / grads / optimizer",
             "plan estimate", "estimate / measured", "ideal = (1,1,1) / world", "measured / ideal"]]
    table = []
    for layout in layouts:
        d, t, p = layout
        world = d * t * p
        got = done[layout]["measured"]
        measured, ideal = got["total"], total / world
        est = estimate_for_run(done[layout]["run_dir"]).model_state
        table.append({"layout": layout, "world": world, "measured": got, "estimate": est, "ideal": ideal})
        rows.append([f"{d} x {t} x {p}", str(world), f"{measured / 2**20:.2f} MiB",
                     " / ".join(f"{got[k] / 2**20:.2f}" for k in ("params", "grads", "optim")) + " MiB",
                     f"{est / 2**20:.2f} MiB", f"{est / measured:.3f}", f"{ideal / 2**20:.2f} MiB",
                     f"{measured / ideal:.2f}"])
    worst = max(abs(r["estimate"] / r["measured"]["total"] - 1) for r in table)
    return {
        "title": "Memory: model-state bytes per rank, world size up to 8",
        "what": ("`model_state_bytes` of metrics.jsonl: what rank 0 (pipeline stage 0, tp rank 0, so it holds the "
                 "embeddings) measured it holds at its peaks during a step: parameters, gradients and optimizer "
                 "state (AdamW moments, plus fp32 master copies with ZeRO-1, which shards them over dp; the default "
                 "stage: ZeRO-0 at dp=1, ZeRO-1 above). Plan estimate: "
                 "`python -m hybridtrain.plan`'s memory model for the same run (`hybridtrain.plan.memory`). Ideal: "
                 "the (1,1,1) total divided by the world size; data parallelism replicates parameters and "
                 "gradients, so only tp x pp approach it."
                 + ("" if not quick else " Quick mode: a subset of the layouts.")),
        "table": rows,
        "summary": f"{len(layouts)} layouts; (1,1,1) total {total / 2**20:.2f} MiB; the estimate is within "
                   f"{worst:.1%} of the measurement for every layout.",
        "raw": [{**r, "layout": list(r["layout"])} for r in table],
        "plot": {"labels": [f"{r['layout'][0]}{r['layout'][1]}{r['layout'][2]}" for r in table],
                 "values": [r["measured"]["total"] / 2**20 for r in table],
                 "values2": [r["estimate"] / 2**20 for r in table],
                 "ylabel": "MiB (rank 0 model state; line: plan estimate)"},
    }


def _run_ds_minimal(out: Path, pp: int, quick: bool) -> dict:
    """bench/startup_deepspeed.py through the deepspeed runner; seconds from launch to its phases."""
    from hybridtrain.ports import free_port

    out.mkdir(parents=True, exist_ok=True)
    shape = {"n_layer": 4, "n_embd": 96 if quick else 192, "n_head": 6, "n_positions": 256, "vocab": 8000,
             "seq_len": 32 if quick else 128, "global_batch": 8, "micro_batch": 1, "pp": pp}
    cmd = [sys.executable, "-u", "-m", "deepspeed.launcher.runner", "--num_gpus", str(pp), "--master_port",
           str(free_port()), "--no_local_rank", str(ROOT / "bench" / "startup_deepspeed.py"), str(out), json.dumps(shape)]
    env = dict(os.environ, OMP_NUM_THREADS="1", PYTHONUNBUFFERED="1")
    t0 = time.perf_counter()
    proc = subprocess.Popen(cmd, cwd=out, env=env, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)
    first, cpu = None, {}
    marker = out / "first_step.json"
    output: list[str] = []
    reader = threading.Thread(target=lambda: output.append(proc.stdout.read()), daemon=True)  # a full pipe never blocks it
    reader.start()
    while proc.poll() is None:
        if first is None and marker.exists() and marker.stat().st_size:
            first = time.perf_counter() - t0
            cpu = tree_cpu(proc.pid)
        time.sleep(0.02)
    reader.join()
    output = "".join(output)
    if proc.returncode != 0 or not marker.exists():
        raise RuntimeError(f"minimal DeepSpeed script failed:\n{output[-4000:]}")
    first = first or time.perf_counter() - t0
    own = json.loads(marker.read_text())
    return {"first_step_s": first, "worker_own_s": own["first step"], "imports_s": own["imports"],
            "build_s": own["engine ready"] - own["init_distributed"], "step_s": own["first step"] - own["engine ready"],
            **{f"cpu_{k}_s": v for k, v in cpu.items()}}


def startup_run(run_dir: Path, quick: bool, root: Path = ROOT) -> dict:
    """One ``python -m hybridtrain`` pp=2 run of ``root``'s checkout to its first step; seconds per phase."""
    import re

    run = check(run_hybridtrain(run_dir, _model(quick) + _layout(1, 1, 2, 1, 1) + ["trainer.max_steps=1",
                                                                                "optim.warmup_steps=0"], root=root))
    m = run.marks
    ready = float(re.search(r"rank 0 ready in ([\d.]+)s", run.output).group(1))
    return {**{f"cpu_{k}_s": v for k, v in run.cpu.items()}, "first_step_s": m["first step"], "config_plan_s": m["config + plan"],
            "data_s": m["data (cached)"] - m["config + plan"],
            "to_runner_s": m["controller to runner"] - m["data (cached)"],
            "runner_to_worker_start_s": m["runner + workers ready"] - ready - m["controller to runner"],
            "worker_ready_s": ready, "first_step_in_worker_s": m["first step"] - m["runner + workers ready"]}


def startup_rows(sides: dict[str, list[dict]], ds: list[dict]) -> list[list[str]]:
    """The phase table: one column per hybridtrain side (``startup_run`` results), then the minimal script."""
    med = {name: {k: median_of(runs, k) for k in runs[0]} for name, runs in sides.items()}
    d = {k: median_of(ds, k) for k in ds[0]}

    def row(label: str, key: str, baseline: str, bold: bool = False) -> list[str]:
        cells = [f"{m[key]:.1f}" for m in med.values()] + [baseline]
        return [label] + ([f"**{c}**" for c in cells] if bold else cells)

    return [["phase (median s)", *sides, "minimal DeepSpeed"],
            row("controller: imports, Hydra compose, plan validation", "config_plan_s", "-"),
            row("controller: data preparation (cache hit)", "data_s", "-"),
            row("controller: writing the run folder, starting the launcher", "to_runner_s", "-"),
            row("DeepSpeed's runner / launcher until the worker starts", "runner_to_worker_start_s",
                f"{d['first_step_s'] - d['worker_own_s']:.1f}"),
            row("worker: imports, init, build model + engine (rank 0)", "worker_ready_s",
                f"{d['worker_own_s'] - d['step_s']:.1f}"),
            row("worker: first step", "first_step_in_worker_s", f"{d['step_s']:.1f}"),
            row("launch to first step", "first_step_s", f"{d['first_step_s']:.1f}", bold=True),
            row("CPU s to the first step: controller", "cpu_controller_s", "-"),
            _cpu_row(med, d, "CPU s: DeepSpeed's runner + launcher", ("cpu_runner_s", "cpu_launch_s")),
            _cpu_row(med, d, "CPU s: the process that imports once and forks the CPU ranks", ("cpu_preload_s",)),
            _cpu_row(med, d, "CPU s: the busiest worker", ("cpu_worker_max_s",)),
            _cpu_row(med, d, "CPU s on the critical path (the sum of the four)", ("cpu_critical_s",), bold=True)]


def _cpu_row(med: dict, d: dict, label: str, keys: tuple[str, ...], bold: bool = False) -> list[str]:
    cells = [f"{sum(m[k] for k in keys):.1f}" for m in med.values()] + [f"{sum(d[k] for k in keys):.1f}"]
    return [label] + ([f"**{c}**" for c in cells] if bold else cells)


def paired_ratio(a: list[dict], b: list[dict], key: str = "first_step_s") -> float:
    """Median over rounds of ``a[r][key] / b[r][key]``: each round's two runs met the same load."""
    import statistics

    return statistics.median(x[key] / y[key] for x, y in zip(a, b))


def startup(work: Path, rounds: int, quick: bool, done: dict, alternate) -> dict:
    """Launch to first step: hybridtrain pp=2 against a minimal DeepSpeed script of the same plan."""
    res = alternate({"hybridtrain": lambda r: startup_run(work / f"ht_{r}", quick),
                     "deepspeed": lambda r: _run_ds_minimal(work / f"ds_{r}", 2, quick)}, rounds)
    a, b = median_of(res["hybridtrain"], "first_step_s"), median_of(res["deepspeed"], "first_step_s")
    rows = startup_rows({"hybridtrain": res["hybridtrain"]}, res["deepspeed"])
    return {
        "title": "Start-up: launch to first step vs a minimal DeepSpeed script",
        "what": ("The same plan (pp=2, 2 processes, one thread each, the benchmark model, global batch 8, "
                 "micro-batch 1). hybridtrain: `python -m hybridtrain ... trainer.max_steps=1` until its metrics.jsonl "
                 "gets the first line, phases from the time-stamped output lines and the worker's own "
                 "`rank 0 ready in` time; CPU seconds of each process when the first step is written (`common.tree_cpu`). "
                 "Baseline: `bench/startup_deepspeed.py` through the deepspeed runner "
                 "(HF GPT2Block layers in a PipelineModule, random tokens) until rank 0 writes its first-step file."),
        "table": rows,
        "summary": f"Launch to first step: hybridtrain **{a:.1f} s**, minimal DeepSpeed {b:.1f} s "
                   f"(difference {a - b:+.1f} s, ratio of the medians {a / b:.2f}x, median of the per-round "
                   f"ratios {paired_ratio(res['hybridtrain'], res['deepspeed']):.2f}x; CPU seconds on the critical "
                   f"path {paired_ratio(res['hybridtrain'], res['deepspeed'], 'cpu_critical_s'):.2f}x).",
        "ratio": a / b, "raw": res,
        "plot": {"labels": ["hybridtrain", "minimal DeepSpeed"], "values": [a, b], "ylabel": "s to first step"},
    }


def _slope(pts: list[tuple[int, float]]) -> float:
    """Least-squares slope of ``(step, MiB)`` points, in MiB per 1000 steps."""
    n = len(pts)
    mx, my = sum(s for s, _ in pts) / n, sum(m for _, m in pts) / n
    return sum((s - mx) * (m - my) for s, m in pts) / max(1e-9, sum((s - mx) ** 2 for s, _ in pts)) * 1000


def soak(work: Path, steps: int) -> dict:
    """``steps`` tiny steps at pp=2; resident memory of each rank sampled against the step.

    Two series per rank: the whole resident set, and its anonymous part (resident minus shared,
    i.e. minus file-backed pages). The training data is memory-mapped (Arrow), so every sample read
    for the first time maps more of the file into the resident set: page cache the kernel can drop,
    not memory the process allocated. A leak shows in the anonymous series."""
    import psutil

    from hybridtrain.launch.ranks import rank_of

    run_dir = work / "run"
    proc = cli.start(run_dir, ["+recipe=gpt_tiny", "parallel.pp=2", "launcher.threads_per_rank=1",
                               f"trainer.max_steps={steps}", "trainer.log_every=10", "trainer.save_final=false"],
                     cwd=ROOT, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
    samples: dict[int, list[tuple[int, float]]] = {}
    anon: dict[int, list[tuple[int, float]]] = {}
    files = RunDir(run_dir)
    while proc.poll() is None:
        time.sleep(2)
        try:
            records = files.metrics() if files.metrics_file.exists() else []
            step = records[-1]["step"] if records else 0
            for p in psutil.Process(proc.pid).children(recursive=True):
                rank = rank_of(p)
                if rank is not None:
                    mem = p.memory_info()
                    samples.setdefault(rank, []).append((step, mem.rss / 2**20))
                    anon.setdefault(rank, []).append((step, (mem.rss - mem.shared) / 2**20))
        except (psutil.Error, ValueError, json.JSONDecodeError, OSError):
            continue
    if proc.returncode != 0:
        raise RuntimeError(f"soak run failed with exit code {proc.returncode} (run folder {run_dir})")
    rows = [["rank", "samples", "RSS at 10% of the steps (MiB)", "RSS at the end (MiB)", "RSS slope (MiB / 1000 steps)",
             "anonymous at 10% / end (MiB)", "anonymous slope (MiB / 1000 steps)"]]
    slopes, anon_slopes = {}, {}
    for rank, pts in sorted(samples.items()):
        pts = [(s, m) for s, m in pts if s >= steps // 10]  # after warm-up
        apts = [(s, m) for s, m in anon[rank] if s >= steps // 10]
        if len(pts) < 3:
            continue
        slopes[rank], anon_slopes[rank] = _slope(pts), _slope(apts)
        rows.append([str(rank), str(len(pts)), f"{pts[0][1]:.1f}", f"{pts[-1][1]:.1f}", f"{slopes[rank]:+.3f}",
                     f"{apts[0][1]:.1f} / {apts[-1][1]:.1f}", f"{anon_slopes[rank]:+.3f}"])
    worst = max(slopes.values(), default=float("nan"))  # growth is what matters: the largest slope, signed
    worst_anon = max(anon_slopes.values(), default=float("nan"))
    change = {r: pts[-1][1] - [m for s, m in pts if s >= steps // 10][0] for r, pts in samples.items() if r in slopes}
    return {
        "title": f"Soak: {steps} tiny steps, resident memory per rank",
        "what": ("`+recipe=gpt_tiny parallel.pp=2`, one thread per rank, metrics every 10 steps, no checkpoint. Every "
                 "2 s the resident set size (psutil) of each worker process is sampled with the step it has reached, "
                 "and its anonymous part (resident minus shared: without the file-backed pages of the memory-mapped "
                 "training data, which grow as samples are read for the first time and which the kernel can drop); "
                 "the slopes are least-squares fits over the samples after the first 10% of the steps."),
        "table": rows,
        "summary": (f"Largest slope: anonymous memory **{worst_anon:+.3f} MiB per 1000 steps** (a leak would show "
                    f"here; target ~0), whole resident set {worst:+.3f} MiB per 1000 steps; resident set at the end "
                    "minus at 10% of the steps: " + ", ".join(f"rank {r} {c:+.1f} MiB" for r, c in sorted(change.items()))
                    + "."),
        "slopes": slopes, "anon_slopes": anon_slopes, "samples": {str(k): v for k, v in samples.items()},
        "anon_samples": {str(k): v for k, v in anon.items()},
        "plot": {"series": {**{f"rank {k} RSS": v for k, v in sorted(samples.items())},
                            **{f"rank {k} anonymous": v for k, v in sorted(anon.items())}},
                 "xlabel": "step", "ylabel": "MiB"},
    }


COMPARISONS = {"overhead": overhead, "pipeline": pipeline, "dp": dp, "tp": tp, "memory": memory, "startup": startup}
