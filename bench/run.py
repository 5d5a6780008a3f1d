"""The benchmark suite: hybridtrain against its baselines, each pair run alternately.

    python -m bench.run --quick              # every comparison, 2 rounds, short runs (~25 min on 2 quiet cores)
    python -m bench.run                      # 5 rounds, longer runs, every layout in the memory table
    python -m bench.run --only overhead,tp   # some comparisons
    python -m bench.run --only overhead --models smollm2_135m            # a 135M model, vs the plain loop and the HF Trainer
    python -m bench.run --only overhead --models llama_192,qwen2_192,phi3_192   # the overhead per family
    python -m bench.run --soak               # 2000 tiny steps: resident memory slope per rank

Comparisons (``bench/README.md``, ``docs/benchmarks.md``): ``overhead`` (1,1,1) vs plain transformers
+ torch.optim.AdamW and the HF Trainer (on each model of ``--models``, ``bench/models.py``); ``pipeline`` pp=2 with 8 micro-batches vs 1; ``dp`` dp=2 vs dp=1; ``tp`` tp=2 vs
tp=1 with the all-reduce share; ``memory`` model-state bytes per rank vs the ideal split;
``startup`` launch to first step vs a minimal DeepSpeed script; ``cp`` context parallelism at cp=2 vs cp=1
at the same sequence length and at half of it (``bench/bench_cp.py``; not in the default list: its own long-row
model, run it with ``--only cp``); ``moe`` a tiny Qwen3-MoE, hybridtrain (1,1,1,1) vs transformers + AdamW and
dp=2 at ep=2 vs ep=1 with the dispatch's all-to-all share (``bench/bench_moe.py``; likewise only with
``--only moe``). Each writes its rows into
``bench/results/suite_DATE.md`` / ``.json`` / ``.png`` together with the machine line (CPU, cores,
versions, load average). The GPU MFU comparison is ``python -m bench.gpu_mfu``.
"""
from __future__ import annotations

import argparse
import datetime as dt
import os
import shutil
import sys
import tempfile
import time
from pathlib import Path

from bench.common import ROOT, alternate, machine, machine_line
from bench.bench_cp import compare as cp_compare
from bench.bench_moe import compare as moe_compare
from bench.comparisons import COMPARISONS, _model, soak
from bench.models import MODELS
from bench.report import write_report


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--quick", action="store_true", help="2 rounds and short runs: first numbers on a busy machine")
    parser.add_argument("--rounds", type=int, help="A B rounds per comparison (default 2 quick, 5 full)")
    parser.add_argument("--only", help=f"comma-separated subset of {', '.join(COMPARISONS)}")
    parser.add_argument("--models", help=f"overhead only: comma-separated models of bench/models.py ({', '.join(MODELS)}), "
                        "one section each (default: the suite's model)")
    parser.add_argument("--soak", action="store_true", help="run only the soak test (2000 steps by default)")
    parser.add_argument("--soak-steps", type=int, default=2000)
    parser.add_argument("--out", type=Path, default=ROOT / "bench" / "results")
    parser.add_argument("--work", type=Path, help="keep run directories here (default: a temporary folder)")
    args = parser.parse_args()
    rounds = args.rounds or (2 if args.quick else 5)
    names = ["soak"] if args.soak else (args.only.split(",") if args.only else list(COMPARISONS))
    comparisons = {**COMPARISONS, "cp": cp_compare, "moe": moe_compare}  # cp, moe: only on request (--only)
    unknown = [n for n in names if n not in comparisons and n != "soak"]
    if unknown:
        parser.error(f"unknown comparison(s) {unknown}; choose from {list(comparisons)}")
    models = args.models.split(",") if args.models else [None]
    if [m for m in models if m is not None and m not in MODELS]:
        parser.error(f"unknown model(s) in {args.models!r}; choose from {list(MODELS)}")

    os.environ.setdefault("HYBRIDTRAIN_CACHE", str(Path(tempfile.gettempdir()) / "hybridtrain-bench-cache"))
    work = args.work or Path(tempfile.mkdtemp(prefix="hybridtrain_bench_"))
    work.mkdir(parents=True, exist_ok=True)
    info = machine()
    print(f"[bench] {machine_line(info)}", flush=True)
    results: dict = {"date": dt.datetime.now().isoformat(timespec="seconds"), "machine": info, "rounds": rounds,
                     "quick": args.quick, "model": "+recipe=gpt_tiny parallel.pp=2" if args.soak else " ".join(_model(args.quick)), "command": " ".join(["python", "-m", "bench.run", *sys.argv[1:]]), "sections": {}}
    report = f"{'soak' if args.soak else 'suite'}_{dt.datetime.now().strftime('%Y-%m-%d_%H%M%S')}"
    md = ""
    done_runs: dict = {}  # layout -> model_state_bytes of every run so far (the memory table reuses them)
    try:
        for name in names:
            t0 = time.perf_counter()
            print(f"[bench] {name} ...", flush=True)
            if name == "soak":
                results["sections"][name] = soak(work / name, args.soak_steps)
            elif name == "overhead":
                for model in models:  # one section per model
                    key = name if model is None else f"{name}:{model}"
                    results["sections"][key] = COMPARISONS[name](work / key.replace(":", "_"), rounds, args.quick,
                                                                 done_runs, alternate, model=model)
                    results["sections"][key]["seconds"] = time.perf_counter() - t0
                    t0 = time.perf_counter()
                    info["loadavg_end"] = os.getloadavg()
                    md = write_report(results, args.out, report)
                continue
            else:
                results["sections"][name] = comparisons[name](work / name, rounds, args.quick, done_runs, alternate)
            results["sections"][name]["seconds"] = time.perf_counter() - t0
            info["loadavg_end"] = os.getloadavg()
            md = write_report(results, args.out, report)  # after every section: a cut-short suite keeps its results
    finally:
        if args.work is None:
            shutil.rmtree(work, ignore_errors=True)
    print(md)


if __name__ == "__main__":
    main()
