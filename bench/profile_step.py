"""Where a hybridtrain step's time goes, per rank: py-spy on every worker, samples split by what is
on the stack (optimizer, gradient reduction, mask and rotary, clipping, loss, tensor-parallel
collectives, pipeline sends, observation, data, forward, backward).

    python -m bench.profile_step OUT_DIR OVERRIDES...      # run, profile steps 2.. of every rank, print the split
    python -m bench.profile_step --split RAW.txt ...       # split py-spy raw files recorded otherwise

py-spy (``pip install py-spy``) attaches to each worker once ``metrics.jsonl`` has its first line,
so the first step's one-off work (allocating the optimizer state, caches) is left out; it samples at
20 Hz without stopping the process (``--nonblocking``) and, by default, not while a thread waits in a
system call, so a rank blocked in a receive or a collective shows little there. Shares are of the
samples inside the training loop (``train`` in ``hybridtrain/train/loop.py``), without the one-off
setup and report of the observer. Use a short run (``trainer.max_steps=3``, ``trainer.report=false``).
"""
from __future__ import annotations

import argparse
import re
import subprocess
import sys
import time
from collections import Counter
from pathlib import Path

RULES = [  # (category, substrings of the stack), first match wins: the narrow ones before forward/backward
    ("tensor-parallel collectives", ["reduce_from_tp", "ColumnParallel.backward", "RowParallel.forward",
                                     "all_reduce (torch/distributed/nn"]),
    ("pipeline loss broadcast", ["_aggregate_total_loss"]),
    ("positions, mask, rotary", ["BlockInputs", "create_causal_mask", "create_sliding_window_causal_mask",
                                 "RotaryEmbedding.forward"]),
    ("gradient norm and clipping", ["clip (hybridtrain/engine/clip.py"]),
    ("data-parallel gradient reduction", ["allreduce_gradients", "buffered_allreduce_fallback", "_exec_reduce_grads"]),
    ("tied-embedding all-reduce", ["_exec_reduce_tied_grads"]),
    ("model-state measurement", ["model_state_bytes (hybridtrain/engine/memory.py"]),
    ("optimizer (AdamW)", ["adamw.py", "adam.py", "_fused_adamw", "_single_tensor_adam"]),
    ("zero_grad", ["zero_grad"]),
    ("loss", ["__call__ (hybridtrain/parallel/layers.py", "cross_entropy", "_VocabParallelCrossEntropy"]),
    ("pipeline send / receive", ["_exec_send_", "_exec_recv_", "p2p.py"]),
    ("backward", ["backward ("]),
    ("data", ["hybridtrain/data/sampler.py", "datawait.py", "_exec_load_micro_batch"]),
    ("observation, metrics, progress bar", ["hybridtrain/observe/observer.py", "hybridtrain/observe/gather.py",
                                            "hybridtrain/observe/resources.py", "tqdm", "MetricsWriter"]),
    ("LM head", ["vocab_parallel_logits", "as_head"]),
    ("forward", ["forward (transformers/", "_run (hybridtrain/models/stages.py", "forward (hybridtrain/",
                 "forward (torch/nn/modules/"]),
]
"""Categories of a sample, matched against its whole stack (py-spy's ``function (file:line)`` frames)."""

LOOP = "train (hybridtrain/train/loop.py"
ONE_OFF = ("Observer.create", "Observer.finish")


def split(raw: Path) -> tuple[Counter, Counter, int]:
    """``(samples per category, samples per leaf frame of the rest, samples in the loop)`` of a py-spy
    ``--format raw`` file (one ``frame;frame;... count`` line per stack)."""
    cats, rest, total = Counter(), Counter(), 0
    for line in raw.read_text().splitlines():
        stack, _, n = line.rpartition(" ")
        if LOOP not in stack or any(k in stack for k in ONE_OFF):
            continue
        total += int(n)
        cat = next((c for c, keys in RULES if any(k in stack for k in keys)), None)
        if cat is None:
            rest[re.sub(r":\d+\)", ")", stack.split(";")[-1])] += int(n)
        else:
            cats[cat] += int(n)
    return cats, rest, total


def report(raw: Path) -> str:
    cats, rest, total = split(raw)
    lines = [f"{raw}: {total} samples in the training loop"]
    lines += [f"  {n / total:7.2%}  {c}" for c, n in cats.most_common()]
    lines.append(f"  {sum(rest.values()) / max(1, total):7.2%}  other: "
                 + ", ".join(f"{k} {n / total:.2%}" for k, n in rest.most_common(3)))
    return "\n".join(lines)


def profile(out: Path, overrides: list[str]) -> list[Path]:
    """Run ``python -m hybridtrain`` with ``overrides`` in ``out/run``; py-spy every worker from its
    second step on; return the raw files, one per rank."""
    from hybridtrain import cli

    import psutil

    from hybridtrain.launch.ranks import rank_of

    run_dir = out / "run"
    proc = cli.start(run_dir, overrides, stdout=open(out / "run.log", "w"), stderr=subprocess.STDOUT)
    metrics = run_dir / "metrics.jsonl"
    while proc.poll() is None and not (metrics.exists() and metrics.stat().st_size):
        time.sleep(0.5)
    spies, files = [], []
    for p in psutil.Process(proc.pid).children(recursive=True):
        try:
            rank = rank_of(p)
            if rank is None:
                continue
        except psutil.Error:
            continue
        files.append(out / f"rank{rank}.txt")
        spies.append(subprocess.Popen(["py-spy", "record", "--pid", str(p.pid), "-r", "20", "--nonblocking",
                                       "-f", "raw", "-o", str(files[-1])], stdout=subprocess.DEVNULL,
                                      stderr=subprocess.DEVNULL))
    code = proc.wait()
    for s in spies:
        s.wait(timeout=60)
    if code != 0:
        raise SystemExit(f"the run failed (exit {code}); see {out / 'run.log'}")
    return sorted(files)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--split", action="store_true", help="only split the given py-spy raw files")
    parser.add_argument("args", nargs="+", help="OUT_DIR OVERRIDES..., or with --split: RAW files")
    a = parser.parse_args()
    if a.split:
        files = [Path(f) for f in a.args]
    else:
        out = Path(a.args[0])
        out.mkdir(parents=True, exist_ok=True)
        files = profile(out, a.args[1:])
    print("\n".join(report(f) for f in files if f.exists()))


if __name__ == "__main__":
    sys.exit(main())
