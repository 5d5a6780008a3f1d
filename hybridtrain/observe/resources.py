"""Memory and device utilization of this rank: resident memory, GPU peak allocation, NVML."""
from __future__ import annotations

import threading


def rss_bytes() -> int:
    """Resident set size of this process (``psutil``)."""
    import psutil

    return int(psutil.Process().memory_info().rss)


def gpu_peak_bytes(device) -> int | None:
    """The most bytes torch's allocator has held on ``device`` since start; ``None`` off CUDA."""
    import torch

    if getattr(device, "type", str(device)) != "cuda" or not torch.cuda.is_available():
        return None
    return int(torch.cuda.max_memory_allocated(device))


class NvmlSampler:
    """Samples this GPU's utilization (percent of time a kernel ran) through NVML in a thread.

    ``pynvml`` (package ``nvidia-ml-py``) is optional: without it, or without a GPU,
    :meth:`create` returns ``None`` and no utilization is reported. NVML itself averages over
    its own sample period; this thread reads it every ``interval_s`` and :meth:`take` returns
    the mean since the previous call.
    """

    def __init__(self, handle, nvml, interval_s: float = 0.2):
        self._handle, self._nvml, self._interval = handle, nvml, interval_s
        self._sum, self._n = 0.0, 0
        self._lock = threading.Lock()
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._run, name="hybridtrain-nvml", daemon=True)
        self._thread.start()

    @classmethod
    def create(cls, device) -> "NvmlSampler | None":
        """A sampler of ``device`` (a CUDA ``torch.device``), or ``None`` without NVML or GPU."""
        if getattr(device, "type", str(device)) != "cuda":
            return None
        try:
            import pynvml
        except ImportError:
            return None
        try:
            import torch

            pynvml.nvmlInit()
            index = device.index if device.index is not None else torch.cuda.current_device()
            handle = nvml_handle(pynvml, str(torch.cuda.get_device_properties(index).uuid))
        except Exception:  # noqa: BLE001 - NVML errors (no driver access): simply no utilization
            return None
        return cls(handle, pynvml)

    def _run(self) -> None:
        while not self._stop.wait(self._interval):
            try:
                util = float(self._nvml.nvmlDeviceGetUtilizationRates(self._handle).gpu)
            except Exception:  # noqa: BLE001 - a transient NVML error loses one sample
                continue
            with self._lock:
                self._sum += util
                self._n += 1

    def take(self) -> float | None:
        """Mean utilization (percent) since the last call; with no sample since (a step shorter than
        the interval) NVML's current reading; ``None`` if NVML fails."""
        with self._lock:
            mean = self._sum / self._n if self._n else None
            self._sum, self._n = 0.0, 0
        if mean is None:
            try:
                mean = float(self._nvml.nvmlDeviceGetUtilizationRates(self._handle).gpu)
            except Exception:  # noqa: BLE001 - no reading this time
                return None
        return mean

    def close(self) -> None:
        """Stop the sampling thread."""
        self._stop.set()
        self._thread.join(timeout=1.0)


def nvml_handle(nvml, uuid: str):
    """The NVML handle of the GPU whose UUID torch reports (``get_device_properties(i).uuid``).

    By UUID, not by index: NVML numbers every GPU of the machine in its own order, while torch's
    index counts only the devices ``CUDA_VISIBLE_DEVICES`` shows (possibly given as UUIDs, or
    reordered by ``CUDA_DEVICE_ORDER``), so an index can name another job's GPU. torch prints the
    UUID without NVML's ``GPU-`` prefix (MIG devices carry ``MIG-``)."""
    if not uuid.startswith(("GPU-", "MIG-")):
        uuid = "GPU-" + uuid
    return nvml.nvmlDeviceGetHandleByUUID(uuid)
