"""Context parallelism benchmark: ``parallel.cp=2`` against whole rows at the same sequence length and at half of it.

    python -m bench.bench_cp                       # 2 rounds, cp2 / cp1 / cp1 at half the length, alternating
    python -m bench.bench_cp --seq-len 2048 --steps 4
    python -m bench.run --only cp                  # the same comparison as a section of the suite

Three sides of ``+recipe=llama_long`` (a 2-layer, 64-wide Llama, fp32, micro-batch 1, global batch 2), one
thread per rank, run alternately in one go: A ``cp=2`` at ``--seq-len`` (2 ranks, each holding half of every
row), B ``cp=1`` at ``--seq-len`` (1 rank, whole rows), C ``cp=1`` at half the length (1 rank holding as many
tokens as a cp rank of A). Reported per side: tokens/s (median over the steps after the first), the peak
resident memory of each rank (``VmHWM``, polled from ``/proc`` while the run lives: it includes the Python,
torch and DeepSpeed baseline of a process, about the same on every side), and auto's estimate of the fullest
rank (:func:`hybridtrain.plan.auto.estimate_layout`, the cp terms included; without that baseline). A against
B is what cp buys at one length; A against C is what cp's all-gathered keys and values (with packed rows its dense mask) and
its communication cost over a rank holding the same tokens alone. Results: ``bench/results/cp_DATE.{md,json}``.
"""
from __future__ import annotations

import argparse
import statistics
import tempfile
import threading
from pathlib import Path

from hybridtrain.cli import REPO as ROOT

SEQ_LEN = 4096
STEPS = 5


def _peak_rss(stop: threading.Event, peaks: dict[int, int]) -> None:
    """Until ``stop``: the largest ``VmHWM`` (peak resident bytes) of every rank process under this one."""
    import psutil

    from hybridtrain.launch.ranks import rank_of

    me = psutil.Process()
    while not stop.is_set():
        for p in me.children(recursive=True):
            try:
                rank = rank_of(p)
                if rank is None:
                    continue
                with open(f"/proc/{p.pid}/status") as f:
                    hwm = next(int(ln.split()[1]) * 1024 for ln in f if ln.startswith("VmHWM:"))
                peaks[rank] = max(peaks.get(rank, 0), hwm)
            except (psutil.Error, OSError, StopIteration, ValueError):
                continue
        stop.wait(0.2)


def overrides(cp: int, seq_len: int, steps: int) -> list[str]:
    """The ``python -m hybridtrain`` overrides of one side."""
    return ["+recipe=llama_long", f"parallel.cp={cp}", f"data.seq_len={seq_len}", f"trainer.max_steps={steps}",
            "trainer.log_every=1", "trainer.save_final=false", "trainer.report=false", "launcher.threads_per_rank=1"]


def estimated_bytes(cp: int, seq_len: int, steps: int) -> int:
    """auto's estimate of the fullest rank of a side (cp terms included)."""
    from hybridtrain import cli
    from hybridtrain.plan import Machine, model_config
    from hybridtrain.plan.auto import estimate_layout
    from hybridtrain.plan.calibrate import Rates

    cfg = cli.compose(overrides(cp, seq_len, steps))
    # the memory estimate does not read the rates
    rates = Rates(flops=1e10, latency=1e-4, bandwidth=1e9, device="cpu", threads=1, layer_overhead=5e-4)
    return estimate_layout(cfg, model_config(cfg), Machine(gpus_per_node=0, fp16_supported=False, cpu_cores=2), rates).memory


def run_side(work: Path, name: str, cp: int, seq_len: int, steps: int, round_: int) -> dict:
    """One run: tokens/s and each rank's peak resident memory."""
    from bench.common import check, run_hybridtrain

    peaks: dict[int, int] = {}
    stop = threading.Event()
    watcher = threading.Thread(target=_peak_rss, args=(stop, peaks), daemon=True)
    watcher.start()
    try:
        run = check(run_hybridtrain(work / f"{name}_r{round_}", overrides(cp, seq_len, steps)))
    finally:
        stop.set()
        watcher.join()
    train = [m for m in run.metrics() if "loss" in m]
    steady = [m for m in train if m["step"] > 1]
    return {"tokens_per_sec": statistics.median(m["tokens_per_sec"] for m in steady),
            "step_time_s": statistics.median(m["step_time_s"] for m in steady),
            "peak_rss_mib": max(peaks.values()) / 2**20 if peaks else 0.0,
            "rank_peak_rss_mib": [peaks[r] / 2**20 for r in sorted(peaks)], "final_loss": train[-1]["loss"]}


def compare(work: Path, rounds: int, quick: bool, done: dict, alternate, seq_len: int = SEQ_LEN,
            steps: int | None = None) -> dict:
    """The comparison as a section of ``bench.run`` (``done`` unused: these runs are not the suite's model)."""
    steps = steps or (4 if quick else STEPS)
    half = seq_len // 2
    sides = {"cp2": (2, seq_len), "cp1": (1, seq_len), "cp1_half": (1, half)}
    res = alternate({name: (lambda r, name=name, cp=cp, s=s: run_side(work, name, cp, s, steps, r))
                     for name, (cp, s) in sides.items()}, rounds)
    est = {name: estimated_bytes(cp, s, steps) / 2**20 for name, (cp, s) in sides.items()}

    def med(side: str, key: str) -> float:
        return statistics.median(r[key] for r in res[side])

    labels = {"cp2": f"A: cp=2, seq {seq_len} (2 ranks)", "cp1": f"B: cp=1, seq {seq_len} (1 rank)",
              "cp1_half": f"C: cp=1, seq {half} (1 rank)"}
    table = [["side", "tokens/s", "tokens/s per rank", "step time (s)", "peak RSS per rank (MiB)",
              "auto's estimate, fullest rank (MiB)"]]
    for side, (cp, _) in sides.items():
        ranks = [statistics.median(r["rank_peak_rss_mib"][i] for r in res[side]) for i in range(cp)]
        table.append([labels[side], f"{med(side, 'tokens_per_sec'):,.0f}", f"{med(side, 'tokens_per_sec') / cp:,.0f}",
                      f"{med(side, 'step_time_s'):.2f}", ", ".join(f"{v:.0f}" for v in ranks), f"{est[side]:.0f}"])
    speed_ab = med("cp2", "tokens_per_sec") / med("cp1", "tokens_per_sec")
    rank_ac = med("cp2", "tokens_per_sec") / 2 / med("cp1_half", "tokens_per_sec")
    mem_ab = med("cp1", "peak_rss_mib") - med("cp2", "peak_rss_mib")
    mem_ac = med("cp2", "peak_rss_mib") - med("cp1_half", "peak_rss_mib")
    summary = (f"A / B tokens/s: **{speed_ab:.2f}x** (ideal 2x: each rank does half the attention and MLP work); "
               f"per rank A / C: **{rank_ac:.2f}x** (ideal 1x). Peak RSS per rank, B - A: **{mem_ab:.0f} MiB** "
               f"(estimated {est['cp1'] - est['cp2']:.0f}); A - C: **{mem_ac:.0f} MiB** (estimated "
               f"{est['cp2'] - est['cp1_half']:.0f}: the gathered keys and values).")
    return {"title": f"Context parallelism: cp=2 vs cp=1 at seq {seq_len} and at {half}",
            "what": ("`+recipe=llama_long` (2 layers, hidden 64, fp32, micro-batch 1, global batch 2), one thread "
                     f"per rank, {steps} steps, medians after the first step; sides alternate A B C A B C. Peak RSS: "
                     "each rank's VmHWM (the process baseline included); estimate: auto's fullest rank, model state "
                     "and activations only."),
            "table": table, "summary": summary, "ratio": speed_ab, "target": 2.0,
            "ratios": {"tokens_per_sec_cp2_over_cp1": speed_ab, "per_rank_tokens_per_sec_cp2_over_cp1_half": rank_ac,
                       "peak_rss_mib_cp1_minus_cp2": mem_ab, "peak_rss_mib_cp2_minus_cp1_half": mem_ac},
            "estimate_mib": est, "raw": res, "seq_len": seq_len, "steps": steps,
            "plot": {"labels": ["cp=2", "cp=1", "cp=1 seq/2"], "values": [med(k, "tokens_per_sec") for k in sides],
                     "ylabel": "tokens/s"}}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--rounds", type=int, default=2)
    parser.add_argument("--seq-len", type=int, default=SEQ_LEN)
    parser.add_argument("--steps", type=int, default=STEPS)
    parser.add_argument("--out", type=Path, default=ROOT / "bench" / "results")
    parser.add_argument("--work", type=Path, help="keep the run folders here")
    args = parser.parse_args()

    from bench.common import alternate, machine, machine_line, write_section

    facts = machine()
    work = args.work or Path(tempfile.mkdtemp(prefix="bench_cp_"))
    work.mkdir(parents=True, exist_ok=True)
    print(f"[bench] {machine_line(facts)}", flush=True)
    section = compare(work, args.rounds, False, {}, alternate, args.seq_len, args.steps)
    write_section(args.out, "cp", section, facts, args.rounds, f"python -m bench.bench_cp --rounds {args.rounds} --seq-len {args.seq_len} --steps {args.steps}")

if __name__ == "__main__":
    main()
