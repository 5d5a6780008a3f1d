"""Machine rates for the cost model: a matmul probe and an all-reduce probe, cached on disk.

The probes run once per (host, device kind, ranks x threads, matmul shape) and are cached as JSON
under ``$HYBRIDTRAIN_CACHE`` (or ``~/.cache/hybridtrain``) ``/calibration/``. The all-reduce probe
spawns as many processes as the node will run ranks (at most 8; gloo on CPU, NCCL over that
many GPUs), so that a CPU node's oversubscription shows in the latency; with fewer than two GPUs
the built-in link numbers are used and the file says so.
"""
from __future__ import annotations

import json
import os
import socket
import time
from dataclasses import asdict, dataclass
from pathlib import Path

from hybridtrain.plan.devices import GpuSpec, gpu_peak_flops, gpu_spec, is_cluster, uses_gpus
from hybridtrain.plan.types import Machine

MAX_PROBE_RANKS = 8
"""The all-reduce probe starts at most this many processes."""
DEFAULT_LINK = {"cpu": (2e-4, 1e9), "cuda": (2e-5, 1e11)}
"""(latency s, bandwidth B/s) used when no all-reduce probe can run."""
INTER_NODE_LINK = {"cpu": (5e-4, 1.25e9), "cuda": (4e-5, 2.5e10)}
"""(latency s, bus bandwidth B/s) of a collective whose group spans nodes, which no probe on one machine
can measure: GPU nodes with one 200 Gb/s InfiniBand (HDR) port per GPU, CPU nodes on 10 Gb Ethernet.
A group that crosses nodes runs at the slower of this and the node's own link."""
ACHIEVED_SHARE = 0.4
"""Share of a GPU's dense peak FLOP/s a training step's matmuls reach (what ``parallel=auto`` assumes for
``launcher.gpu_type``; MFU of well-tuned large runs is 40-50%)."""


@dataclass(frozen=True)
class Rates:
    """What one rank achieves on this machine."""

    flops: float
    """Sustained matmul FLOP/s of one rank (with its threads, fp32 on CPU / bf16 on GPU)."""
    latency: float
    """Seconds of one small collective (the alpha of alpha-beta)."""
    bandwidth: float
    """Bytes/s of a large all-reduce's bus bandwidth (ring: ``2 (n-1)/n x bytes / bandwidth``)."""
    device: str
    threads: int
    measured_link: bool = True
    layer_overhead: float = 0.0
    """Seconds of framework overhead per pipeline layer per micro-batch (forward + backward of a
    tiny block: op dispatch, autograd), which dominates small models on CPU."""
    inter_latency: float | None = None
    """Latency of a collective across nodes; ``None``: :data:`INTER_NODE_LINK` of the device."""
    inter_bandwidth: float | None = None
    """Bus bandwidth of a collective across nodes; ``None``: :data:`INTER_NODE_LINK` of the device."""

    def link(self, across_nodes: bool) -> tuple[float, float]:
        """(latency, bandwidth) of a collective within a node, or of one whose group spans nodes (never
        faster than within a node)."""
        if not across_nodes:
            return self.latency, self.bandwidth
        lat, bw = INTER_NODE_LINK[self.device]
        return (max(self.latency, self.inter_latency or lat),
                min(self.bandwidth, self.inter_bandwidth or bw))


def cache_dir() -> Path:
    """``$HYBRIDTRAIN_CACHE`` or ``~/.cache/hybridtrain``, ``/calibration`` (:class:`hybridtrain.cache.CacheDir`)."""
    from hybridtrain.cache import CacheDir

    return CacheDir.from_env().calibration


REPEATS = {"cpu": 1, "cuda": 20}
"""Kernels timed per measurement: a GPU is synchronised once per ``REPEATS`` launches (a sync per matmul
would time the host round trip, not the device); a CPU runs each op to the end before returning."""


def matmul_flops(threads: int, device: str = "cpu", shape: tuple[int, int] = (512, 512),
                 seconds: float = 0.5) -> float:
    """FLOP/s of ``[tokens, hidden] x [hidden, 4 hidden]`` matmuls (``shape = (tokens, hidden)``, the
    model's MLP) with ``threads`` torch threads, median of a short loop."""
    import torch

    old = torch.get_num_threads()
    torch.set_num_threads(threads)
    try:
        dtype = torch.bfloat16 if device == "cuda" else torch.float32
        m, k = (max(s, 1) for s in shape)
        a = torch.randn(m, k, device=device, dtype=dtype)
        b = torch.randn(k, 4 * k, device=device, dtype=dtype)
        reps = REPEATS[device]
        times, end = [], time.perf_counter() + seconds
        while time.perf_counter() < end or len(times) < 3:
            _settle(device)
            t0 = time.perf_counter()
            for _ in range(reps):
                a @ b
            _settle(device)
            times.append((time.perf_counter() - t0) / reps)
        return 2 * m * k * 4 * k / sorted(times)[len(times) // 2]
    finally:
        torch.set_num_threads(old)


def layer_overhead(threads: int, device: str = "cpu", seconds: float = 0.5) -> float:
    """Seconds of one forward + backward of a tiny transformer block (1 token, width 16): the fixed
    cost per layer call that no FLOP count sees."""
    import torch

    old = torch.get_num_threads()
    torch.set_num_threads(threads)
    try:
        block = torch.nn.TransformerEncoderLayer(d_model=16, nhead=2, dim_feedforward=32, dropout=0.0,
                                                 batch_first=True).to(device)
        x = torch.randn(1, 1, 16, device=device, requires_grad=True)
        reps = REPEATS[device]
        times, end = [], time.perf_counter() + seconds
        while time.perf_counter() < end or len(times) < 5:
            _settle(device)
            t0 = time.perf_counter()
            for _ in range(reps):
                block(x).sum().backward()
            _settle(device)
            times.append((time.perf_counter() - t0) / reps)
        return sorted(times)[len(times) // 2]
    finally:
        torch.set_num_threads(old)


def _settle(device: str) -> None:
    """Wait for the device's queued work (a no-op on CPU, whose ops finish before they return)."""
    if device == "cuda":
        import torch

        torch.cuda.synchronize()


def _device_probe_worker(_: int, threads: int, device: str, shape: tuple[int, int], out: str) -> None:
    Path(out).write_text(json.dumps([matmul_flops(threads, device, shape), layer_overhead(threads, device)]))


def device_probes(threads: int, device: str, shape: tuple[int, int], in_child: bool) -> tuple[float, float]:
    """``(matmul FLOP/s, layer overhead s)`` of this machine. ``in_child``: measured in a spawned process
    (what a GPU gets: the controller itself never creates a CUDA context, which would hold GPU 0's memory
    for the whole run while the rank placed there trains)."""
    if not in_child:
        return matmul_flops(threads, device, shape), layer_overhead(threads, device)
    import tempfile

    import torch.multiprocessing as mp

    with tempfile.TemporaryDirectory() as tmp:
        out = os.path.join(tmp, "device.json")
        mp.start_processes(_device_probe_worker, args=(threads, device, tuple(shape), out), nprocs=1, join=True,
                           start_method="spawn")
        flops, overhead = json.loads(Path(out).read_text())
    return flops, overhead


def _allreduce_worker(rank: int, world: int, port: int, backend: str, out: str) -> None:
    import torch
    import torch.distributed as dist

    torch.set_num_threads(1)
    dist.init_process_group(backend, init_method=f"tcp://127.0.0.1:{port}", rank=rank, world_size=world)
    device = f"cuda:{rank}" if backend == "nccl" else "cpu"
    results = {}
    for numel in (1, 1 << 20):
        x = torch.ones(numel, device=device)
        for _ in range(2):
            dist.all_reduce(x)
        times = []
        for _ in range(5):
            dist.barrier()
            t0 = time.perf_counter()
            dist.all_reduce(x)
            if backend == "nccl":
                torch.cuda.synchronize()
            times.append(time.perf_counter() - t0)
        results[numel] = sorted(times)[len(times) // 2]
    if rank == 0:
        Path(out).write_text(json.dumps(results))
    dist.destroy_process_group()


def allreduce_link(device: str, nprocs: int = 2) -> tuple[float, float, bool]:
    """(latency, bandwidth, measured) from timing 4-byte and 4-MiB all-reduces among ``nprocs``
    processes: as many as a node's ranks, so that CPU oversubscription is in the numbers."""
    import tempfile

    import torch
    import torch.multiprocessing as mp

    if device == "cuda":
        nprocs = min(nprocs, torch.cuda.device_count())
        if nprocs < 2:
            return (*DEFAULT_LINK[device], False)
    nprocs = max(2, nprocs)
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    with tempfile.TemporaryDirectory() as tmp:
        out = os.path.join(tmp, "allreduce.json")
        mp.start_processes(_allreduce_worker, args=(nprocs, port, "nccl" if device == "cuda" else "gloo", out),
                           nprocs=nprocs, join=True, start_method="spawn")
        res = {int(k): v for k, v in json.loads(Path(out).read_text()).items()}
    latency = res[1]
    big = 4 * (1 << 20)
    bandwidth = 2 * (nprocs - 1) / nprocs * big / max(1e-9, res[1 << 20] - latency)  # ring: 2 (n-1)/n x bytes
    return latency, bandwidth, True


def builtin(device: str, threads: int = 1) -> Rates:
    """Rates without probing: a recent data-center GPU (bf16 matmuls at about 300 TFLOP/s achieved,
    NVLink-class all-reduce), or a CPU core; what ``plan.calibrate=false`` and cluster plans use."""
    lat, bw = DEFAULT_LINK[device]
    if device == "cuda":
        return Rates(flops=3e14, latency=lat, bandwidth=bw, device=device, threads=1, measured_link=False,
                     layer_overhead=2e-5)
    return Rates(flops=2e10 * threads, latency=lat, bandwidth=bw, device=device, threads=threads,
                 measured_link=False, layer_overhead=1e-3)


def rates(threads: int, calibrate: bool = True, shape: tuple[int, int] = (512, 512), ranks: int = 2) -> Rates:
    """This machine's :class:`Rates` for ``ranks`` ranks of ``threads`` threads on this node and
    matmuls of ``shape`` (tokens per micro-batch, hidden), from the cache or the probes."""
    import torch

    device = "cuda" if torch.cuda.is_available() else "cpu"
    if not calibrate:
        return builtin(device, threads)
    ranks = max(2, min(ranks, MAX_PROBE_RANKS))
    path = cache_dir() / f"{socket.gethostname()}-{device}-{ranks}x{threads}t-{shape[0]}x{shape[1]}.json"
    if path.is_file():
        try:
            return Rates(**json.loads(path.read_text()))
        except (TypeError, ValueError):
            pass  # an old or damaged cache file: measure again
    flops, overhead = device_probes(threads, device, shape, in_child=device == "cuda")
    lat, bw, measured = allreduce_link(device, ranks)
    found = Rates(flops=flops, latency=lat, bandwidth=bw, device=device, threads=threads, measured_link=measured,
                  layer_overhead=overhead)
    path.parent.mkdir(parents=True, exist_ok=True)
    tmp = path.with_suffix(f".{os.getpid()}.tmp")
    tmp.write_text(json.dumps(asdict(found), indent=1))
    tmp.replace(path)  # concurrent planners (test workers, two runs) never read half a file
    return found


def gpu_rates(spec: GpuSpec, precision: str, tf32: bool) -> Rates:
    """Rates of a known GPU model without probing it: :data:`ACHIEVED_SHARE` of its dense peak for
    ``precision``, and its node's NVLink or PCIe link (:data:`hybridtrain.plan.devices.GPU_SPECS`)."""
    lat, bw = spec.link
    return Rates(flops=ACHIEVED_SHARE * gpu_peak_flops(spec, precision, tf32), latency=lat, bandwidth=bw,
                 device="cuda", threads=1, measured_link=False, layer_overhead=2e-5)


def planned_rates(launcher, machine: Machine, precision: str, tf32: bool, threads: int, calibrate: bool = True,
                  shape: tuple[int, int] = (512, 512), ranks: int = 2) -> Rates:
    """The rates ``parallel=auto`` plans with: a cluster's GPUs from ``launcher.gpu_type``
    (:func:`gpu_rates`); the built-in rates for nodes this machine cannot probe (a cluster's, or GPUs
    asked for on a machine without them); else this machine's probed and cached :func:`rates`."""
    gpus = uses_gpus(launcher, machine)
    spec = gpu_spec(launcher) if is_cluster(launcher) else None
    if gpus and spec is not None:
        return gpu_rates(spec, precision, tf32)
    if is_cluster(launcher) or (gpus and not machine.gpus_per_node):
        return builtin("cuda" if gpus else "cpu", threads)
    return rates(1 if gpus else threads, calibrate, shape, ranks)
