"""Peak FLOP/s of one device, for MFU: the table of known GPUs, or a measured and cached CPU probe.

The GPU numbers (:data:`hybridtrain.gpus.GPUS`, which cites the data sheets) are NVIDIA's dense (no
sparsity) figures: bf16 (also serving fp16: equal on every GPU listed) and TF32 on the tensor cores,
plain fp32 on the CUDA cores. An fp32 run is measured against the TF32 rate when ``trainer.tf32`` lets
its matmuls use TF32 (the default on GPUs), else against plain fp32. On a CPU there is no data sheet worth trusting (clock,
SIMD width and threads vary), so :func:`probe_cpu_tflops` times large matmuls with the rank's
thread count and caches the result on disk; a probe slowed down by other processes is scaled up
by the share of the cores it got and repeated next time, and :meth:`Peak.mfu` never reports more
than 100% (a step faster than the peak raises the peak). ``trainer.peak_tflops`` overrides both.
"""
from __future__ import annotations

import json
import os
import platform
import time
from dataclasses import dataclass
from pathlib import Path

from hybridtrain.gpus import gpu_named, rate_key


@dataclass
class Peak:
    """The peak FLOP/s MFU divides by, and where it came from."""

    tflops: float | None
    """Peak TFLOP/s of one device (one rank); ``None`` when unknown (no MFU is reported)."""
    source: str
    """``trainer.peak_tflops``, ``table: <GPU>``, ``cpu probe (...)`` or why it is unknown."""
    probed: bool = False
    """Measured by the CPU probe (a lower bound of the real peak when other processes competed)."""

    def mfu(self, tflops: float) -> float | None:
        """``tflops / peak`` (``None`` without a peak). A probed CPU peak below a step's achieved rate
        was measured too low (other processes slowed the probe down): the peak is raised to that
        rate, so the MFU shown never exceeds 100%. Table and configured peaks are kept as given."""
        if not self.tflops:
            return None
        if self.probed and tflops > self.tflops:
            if "raised" not in self.source:
                self.source += "; raised to a step's measured rate (the probe ran slowed down)"
            self.tflops = tflops
        return tflops / self.tflops


def gpu_peak_tflops(device_name: str, precision: str, tf32: bool = False) -> tuple[str, float] | None:
    """``(table key, TFLOP/s)`` of the GPU table's row (:data:`hybridtrain.gpus.GPUS`) whose name occurs
    in ``device_name`` (longest names first, so ``H100 PCIe`` wins over ``H100``); ``None`` for an
    unknown GPU."""
    gpu = gpu_named(device_name)
    return (gpu.name, gpu.tflops[rate_key(precision, tf32)]) if gpu is not None else None


def cpu_model() -> str:
    """The CPU model name (``/proc/cpuinfo``), or ``platform.processor()``."""
    try:
        for line in Path("/proc/cpuinfo").read_text().splitlines():
            if line.startswith("model name"):
                return line.split(":", 1)[1].strip()
    except OSError:
        pass
    return platform.processor() or platform.machine()


def probe_key(threads: int, precision: str) -> str:
    """The cache key of a CPU probe: CPU model, threads, dtype and torch version."""
    import torch

    return f"{cpu_model()}|threads={threads}|{precision}|torch={torch.__version__}"


def _busy_cpu_seconds() -> float | None:
    """CPU seconds every process of the machine has run so far (``/proc/stat``), or ``None``."""
    try:
        fields = Path("/proc/stat").read_text().split("\n", 1)[0].split()[1:]
    except OSError:
        return None
    user, nice, system, _idle, _iowait, irq, softirq, steal = (int(x) for x in fields[:8])
    return (user + nice + system + irq + softirq + steal) / os.sysconf("SC_CLK_TCK")


def measure_matmul_tflops(threads: int, precision: str, n: int = 1024, seconds: float = 0.5) -> tuple[float, float]:
    """``(best TFLOP/s, others' share)`` of ``[n, n] @ [n, n]`` matmuls with ``threads`` torch
    threads (dtype of ``precision``), over repeated rounds of about ``seconds / 5`` each.

    ``others' share``: the CPU time other processes ran during the probe, as a fraction of the
    probe's cores x seconds (0 when unknown); above :data:`CONTENDED` the rate is too low."""
    import torch

    dtype = {"fp32": torch.float32, "bf16": torch.bfloat16, "fp16": torch.float16}[precision]
    old = torch.get_num_threads()
    torch.set_num_threads(threads)
    try:
        a, b = torch.randn(n, n).to(dtype), torch.randn(n, n).to(dtype)
        for _ in range(3):  # warm-up: thread pool, caches, frequency
            torch.mm(a, b)
        busy0, own0, wall0 = _busy_cpu_seconds(), time.process_time(), time.perf_counter()
        best, deadline = 0.0, time.perf_counter() + seconds
        while time.perf_counter() < deadline:
            reps, t0 = 0, time.perf_counter()
            while time.perf_counter() - t0 < seconds / 5:
                torch.mm(a, b)
                reps += 1
            best = max(best, 2.0 * n**3 * reps / (time.perf_counter() - t0))
        busy1, own1, wall1 = _busy_cpu_seconds(), time.process_time(), time.perf_counter()
        others = 0.0
        if busy0 is not None and busy1 is not None:
            others = max(0.0, (busy1 - busy0) - (own1 - own0)) / (threads * (wall1 - wall0))
        return best / 1e12, others
    finally:
        torch.set_num_threads(old)


CONTENDED = 0.1
"""A probe during which other processes ran more than this share of its cores x seconds is
*contended*: kept (the largest rate measured so far counts) but measured again by the next run,
until one probe runs on a quiet machine or :data:`MAX_PROBES` have been taken."""
MAX_PROBES = 5
"""Contended probes after which an entry is kept as it is (the fastest of them): on a machine that is
never quiet (a CI runner with parallel jobs) every run would otherwise spend ~0.5 s x threads of CPU
at start-up probing again, while the kept rate, the fastest of several, hardly moves any more."""
MAX_OTHERS = 0.75
"""The largest share of the cores a probe is assumed to have lost to other processes when its rate
is scaled up (at most 4x)."""


def probe_cpu_tflops(cache_file: Path, threads: int, precision: str) -> tuple[float, bool]:
    """``(TFLOP/s, from_cache)``: the cached probe of this CPU, thread count and dtype, or a new
    measurement (:func:`measure_matmul_tflops`) added to ``cache_file``.

    A cache entry is ``{"tflops", "quiet"}``. A busy machine can only make a probe too slow, which
    would make MFU too high (a new user's first run showed 143%), so a probe's rate is divided by
    the share of the cores it got (``1 - others``, :func:`measure_matmul_tflops`); a probe taken
    while other processes competed (``quiet: false``, or an entry of an older format) is repeated
    by the next run (up to :data:`MAX_PROBES` probes in all), and the entry keeps the largest rate
    measured."""
    key = probe_key(threads, precision)
    try:
        cache = json.loads(cache_file.read_text())
    except (OSError, ValueError):
        cache = {}
    entry = cache.get(key)
    if not isinstance(entry, dict):  # absent, or a bare number of the first format (load unknown)
        entry = {"tflops": float(entry), "quiet": False, "probes": 0} if isinstance(entry, (int, float)) else None
    if entry is not None and (entry.get("quiet") or int(entry.get("probes", 1)) >= MAX_PROBES):
        return float(entry["tflops"]), True
    tflops, others = measure_matmul_tflops(threads, precision)
    quiet = others <= CONTENDED
    tflops /= 1.0 - min(others, MAX_OTHERS)  # the rate the probe would have had with its cores to itself
    probes = 1
    if entry is not None:
        tflops = max(tflops, float(entry["tflops"]))
        probes += int(entry.get("probes", 1))
    cache[key] = {"tflops": tflops, "quiet": quiet, "probes": probes}
    cache_file.parent.mkdir(parents=True, exist_ok=True)
    tmp = cache_file.with_name(f".{cache_file.name}.{os.getpid()}")
    tmp.write_text(json.dumps(cache, indent=1))
    tmp.replace(cache_file)  # atomic: two runs probing at once never leave a torn file
    return tflops, False


def resolve_peak(override: float | None, precision: str, device_name: str | None, cache_file: Path,
                 threads: int, tf32: bool = False) -> Peak:
    """The peak of one rank's device: ``override`` (``trainer.peak_tflops``), else the GPU table for
    ``device_name`` (``None`` on CPU; ``tf32``: an fp32 run's matmuls use TF32), else the cached CPU
    probe with ``threads`` threads."""
    if override:
        return Peak(float(override), "trainer.peak_tflops")
    if device_name is not None:
        hit = gpu_peak_tflops(device_name, precision, tf32)
        if hit is None:
            return Peak(None, f"unknown GPU {device_name!r}: set trainer.peak_tflops for MFU")
        return Peak(hit[1], f"table: {hit[0]} {rate_key(precision, tf32)}")
    tflops, cached = probe_cpu_tflops(cache_file, threads, precision)
    how = "cached in" if cached else "measured now, cached in"
    return Peak(tflops, f"cpu matmul probe, {threads} thread(s), {precision} ({how} {cache_file})", probed=True)
