"""Start-up before and after a change: hybridtrain at a git revision, this checkout, and the minimal
DeepSpeed script, each launched to its first step, alternated round by round.

    python bench/startup_ab.py --rev d92ab61 --rounds 7

The revision is exported with ``git archive`` into the work folder (the repository is not
touched) and run with its own code (``PYTHONPATH`` and working directory); both sides share the
data cache, and one unrecorded warm-up round runs first. The plan and phases are those of the suite's
``startup`` comparison (``bench/comparisons.py``). On a shared machine absolute seconds move with
the load, so the ratios are the result: the median over rounds of each side's time over the
baseline's time in the same round, for the wall time and for the CPU seconds on the critical path
(``common.tree_cpu``), which other processes stretch far less. Writes ``bench/results/startup_ab_DATE.md`` / ``.json``.
"""
from __future__ import annotations

import argparse
import datetime as dt
import json
import os
import subprocess
import sys
import tempfile
from pathlib import Path

from bench.common import ROOT, alternate, machine, machine_line, median_of
from bench.comparisons import _run_ds_minimal, paired_ratio, startup_rows, startup_run
from bench.report import _table


def export(rev: str, dest: Path) -> Path:
    """The tree of ``rev`` in ``dest`` (``git archive``)."""
    dest.mkdir(parents=True, exist_ok=True)
    archive = subprocess.run(["git", "-C", str(ROOT), "archive", rev], capture_output=True, check=True).stdout
    subprocess.run(["tar", "-x", "-C", str(dest)], input=archive, check=True)
    return dest


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--rev", required=True, help="the git revision to compare with (e.g. main, a commit)")
    parser.add_argument("--rounds", type=int, default=7)
    parser.add_argument("--quick", action="store_true", help="the suite's quick model (gpt_tiny, 32 tokens)")
    parser.add_argument("--out", type=Path, default=ROOT / "bench" / "results")
    args = parser.parse_args()
    os.environ.setdefault("HYBRIDTRAIN_CACHE", str(Path(tempfile.gettempdir()) / "hybridtrain-bench-cache"))
    work = Path(tempfile.mkdtemp(prefix="hybridtrain_startup_ab_"))
    old = export(args.rev, work / "tree")
    rev = subprocess.run(["git", "-C", str(ROOT), "rev-parse", "--short", args.rev], capture_output=True, text=True,
                         check=True).stdout.strip()
    head = subprocess.run(["git", "-C", str(ROOT), "rev-parse", "--short", "HEAD"], capture_output=True, text=True,
                          check=True).stdout.strip()
    before, after = f"before ({rev})", f"after ({head})"
    sides = {before: lambda r: startup_run(work / f"old_{r}", args.quick, root=old),
             after: lambda r: startup_run(work / f"new_{r}", args.quick),
             "deepspeed": lambda r: _run_ds_minimal(work / f"ds_{r}", 2, args.quick)}
    info = machine()
    print(f"[bench] {machine_line(info)}", flush=True)
    for side in sides.values():  # warm-up (caches, page cache), not recorded
        side("warm")
    res = alternate(sides, args.rounds)
    info["loadavg_end"] = os.getloadavg()
    ds = res.pop("deepspeed")
    rows = startup_rows(res, ds)
    ratios = {name: paired_ratio(runs, ds) for name, runs in res.items()}
    cpu = {name: paired_ratio(runs, ds, "cpu_critical_s") for name, runs in res.items()}
    summary = "; ".join(f"{name}: {median_of(runs, 'first_step_s'):.1f} s, **{ratios[name]:.2f}x** the minimal "
                        f"script's wall time, {cpu[name]:.2f}x its CPU seconds on the critical path"
                        for name, runs in res.items())
    stamp = dt.datetime.now().strftime("%Y-%m-%d_%H%M%S")
    cmd = " ".join(["python", "-m", "bench.startup_ab", *sys.argv[1:]])
    md = "\n".join([f"# Start-up before and after, {stamp}", "", f"Machine: {machine_line(info)}", "",
                    f"Command: `{cmd}`; {args.rounds} rounds after one warm-up round, sides alternated "
                    f"({before}, {after}, minimal DeepSpeed); medians. Plan: pp=2, 2 processes, one thread each, "
                    f"{'gpt_tiny with 32 tokens' if args.quick else 'gpt_tiny widened to 192, 128 tokens'}, "
                    "global batch 8, micro-batch 1.", ""]
                   + _table(rows) + ["", f"Launch to first step, median over rounds of the time over the minimal "
                                         f"script's in the same round: {summary}.", ""])
    args.out.mkdir(parents=True, exist_ok=True)
    (args.out / f"startup_ab_{stamp}.md").write_text(md)
    (args.out / f"startup_ab_{stamp}.json").write_text(json.dumps(
        {"command": cmd, "machine": info, "rounds": args.rounds, "ratios": ratios, "cpu_ratios": cpu, "raw": {**res, "deepspeed": ds}},
        indent=1, default=str))
    print(md)


if __name__ == "__main__":
    main()
