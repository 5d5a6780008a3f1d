"""Benchmark-only timer of ``torch.distributed.all_to_all_single`` (the expert-parallel dispatch's exchanges).

``bench/inject/sitecustomize.py`` calls :func:`install` when ``HT_BENCH_A2A_DIR`` is set, in the controller
(the CPU ranks are forked from it and inherit the wrapped function) and in any rank started as its own
interpreter. The library itself never times anything: without the variable nothing is patched.

Every call appends its wall seconds as one line to ``DIR/rank<R>.txt`` (``R``: the global rank), written
unbuffered because a rank leaves with ``os._exit`` (no buffer would be flushed). On gloo the collective
returns when the exchange is done, so a call's time includes waiting for the slower peer. Every
``all_to_all_single`` of a run is counted: in hybridtrain only the dispatch of
:class:`hybridtrain.parallel.experts.ExpertDispatch` calls it (the split sizes, the rows, the local expert ids
and the outputs forward; the rows and outputs again in the backward).
"""
from __future__ import annotations

import os
import time
from pathlib import Path

ENV = "HT_BENCH_A2A_DIR"
"""The variable naming the folder the per-rank files go to."""


def install(directory: str | os.PathLike) -> None:
    """Wrap ``torch.distributed.all_to_all_single`` so that every call's seconds go to ``directory``."""
    import torch.distributed as dist

    real = dist.all_to_all_single
    if getattr(real, "_bench_timed", False):
        return
    folder = Path(directory)
    files: dict[int, int] = {}  # pid -> descriptor: a forked rank opens its own

    def timed(*args, **kwargs):
        t0 = time.perf_counter()
        out = real(*args, **kwargs)
        seconds = time.perf_counter() - t0
        pid = os.getpid()
        if pid not in files:
            folder.mkdir(parents=True, exist_ok=True)
            files[pid] = os.open(folder / f"rank{dist.get_rank()}.txt", os.O_WRONLY | os.O_CREAT | os.O_APPEND)
        os.write(files[pid], f"{seconds:.9f}\n".encode())
        return out

    timed._bench_timed = True
    dist.all_to_all_single = timed


def read(directory: str | os.PathLike) -> dict[int, list[float]]:
    """Each rank's call times, in call order (ranks that made no call are absent)."""
    out = {}
    for path in sorted(Path(directory).glob("rank*.txt")):
        out[int(path.stem[4:])] = [float(x) for x in path.read_text().split()]
    return out


def per_step(calls: list[float], steps: int) -> list[float]:
    """The seconds of each of ``steps`` optimizer steps, when every step made the same number of calls (the
    dispatch runs a fixed number of exchanges per MoE block and micro-batch); ``ValueError`` otherwise."""
    if steps <= 0 or len(calls) % steps:
        raise ValueError(f"{len(calls)} all-to-all calls do not split evenly into {steps} steps")
    n = len(calls) // steps
    return [sum(calls[i * n:(i + 1) * n]) for i in range(steps)]
