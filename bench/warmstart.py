"""Warm starts against fresh interpreters: the same short run (``gpt_tiny`` at dp = 2, 5 steps, a checkpoint at the
end: what most of the test suite's runs are) started by :func:`hybridtrain.cli.run` as a fresh ``python -m
hybridtrain`` and forked by a warm-start server (:mod:`hybridtrain.warmstart`), alternated round by round.

    python -m bench.warmstart --rounds 5

Both sides must train the same losses. On a shared machine absolute seconds move with the load, so the
result is the median over rounds of the warm run's wall time over the fresh run's in the same round.
Writes ``bench/results/warmstart_DATE.md`` / ``.json``.
"""
from __future__ import annotations

import argparse
import datetime as dt
import json
import os
import statistics
import tempfile
import time
from pathlib import Path

from bench.common import ROOT, alternate, machine, machine_line

RUN = ["+recipe=gpt_tiny", "parallel.dp=2", "trainer.max_steps=5", "trainer.report=false"]


def main() -> None:
    from hybridtrain import cli
    from hybridtrain.rundir import RunDir
    from hybridtrain.warmstart import Server

    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--rounds", type=int, default=5)
    parser.add_argument("--out", type=Path, default=ROOT / "bench" / "results")
    args = parser.parse_args()
    work = Path(tempfile.mkdtemp(prefix="hybridtrain_warmstart_"))
    os.environ[cli.WARM_START] = str(work / "warm.sock")
    server = Server(work, cli.environment(None))

    def side(name: str, env: dict | None):
        def one(r: int) -> dict:
            t0 = time.perf_counter()
            cli.run(work / f"{name}_{r}", RUN, timeout=600, cwd=ROOT, env=env, check=True)  # env: refused, fresh (a HYBRIDTRAIN_* one would be served)
            return {"wall_s": time.perf_counter() - t0, "losses": RunDir(work / f"{name}_{r}").losses()}
        return one

    sides = {"fresh": side("fresh", {"WARM_START_BENCH_FRESH": "1"}), "warm": side("warm", None)}
    info = machine()
    print(f"[bench] {machine_line(info)}", flush=True)
    for fn in sides.values():  # warm-up (data cache, page cache), not recorded
        fn(-1)
    res = alternate(sides, args.rounds)
    server.close()
    info["loadavg_end"] = list(os.getloadavg())
    assert all(a["losses"] == b["losses"] for a, b in zip(res["fresh"], res["warm"])), "warm and fresh runs differ"
    ratios = [w["wall_s"] / f["wall_s"] for f, w in zip(res["fresh"], res["warm"])]
    fresh = statistics.median(r["wall_s"] for r in res["fresh"])
    warm = statistics.median(r["wall_s"] for r in res["warm"])
    stamp = dt.datetime.now().strftime("%Y-%m-%d_%H%M%S")
    args.out.mkdir(parents=True, exist_ok=True)
    (args.out / f"warmstart_{stamp}.json").write_text(json.dumps(
        {"machine": info, "run": RUN, "rounds": args.rounds, "fresh": res["fresh"], "warm": res["warm"],
         "wall_ratio_per_round": ratios}, indent=1))
    lines = [f"# Warm starts ({stamp})", "", machine_line(info), "",
             f"`python -m bench.warmstart --rounds {args.rounds}`: `{' '.join(RUN)}`, {args.rounds} rounds alternated.",
             "", "| | wall time (median) | warm / fresh, median of per-round ratios |", "|---|---|---|",
             f"| fresh interpreter | {fresh:.2f} s | 1 |",
             f"| warm start | {warm:.2f} s | **{statistics.median(ratios):.2f}x** |", "",
             "Both sides trained the same losses in every round."]
    (args.out / f"warmstart_{stamp}.md").write_text("\n".join(lines) + "\n")
    print("\n".join(lines))


if __name__ == "__main__":
    main()
