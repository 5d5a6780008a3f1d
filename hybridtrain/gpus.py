"""The GPU models hybridtrain knows: one row per model, and the views the other layers read.

A row (:class:`Gpu`) holds the model's device-name fragment (matched against
``torch.cuda.get_device_name()``), its dense peak TFLOP/s, and, where it is a value of
``launcher.gpu_type``, the gpu_type key(s) with their memory, the link among the GPUs of one node and
bf16 support. Everything else is derived from :data:`GPUS`: the enum values of ``launcher.gpu_type``
(:data:`GPU_TYPES`, read by :mod:`hybridtrain.config.choices`), the peak table MFU divides by
(:data:`GPU_PEAK_TFLOPS`, :func:`gpu_named`, used by :mod:`hybridtrain.observe.peak`) and the plan's
device facts per gpu_type (:data:`GPU_SPECS`, used by :mod:`hybridtrain.plan.devices`). A new GPU is
one row.

This module sits at the bottom of the package: it imports nothing of hybridtrain, torch or DeepSpeed.
"""
from __future__ import annotations

from dataclasses import dataclass, field

NVLINK3 = (1.5e-5, 2.3e11)
"""(latency s, all-reduce bus bandwidth B/s) among the GPUs of an A100 SXM node (NVLink 3, NVSwitch)."""
NVLINK4 = (1.5e-5, 4.5e11)
"""The same for H100/H200 SXM nodes (NVLink 4)."""
NVLINK5 = (1.5e-5, 8.0e11)
"""The same for B200/GB200 (NVLink 5)."""
NVLINK2 = (2.0e-5, 1.3e11)
"""The same for V100 SXM2 nodes (NVLink 2)."""
PCIE4 = (2.0e-5, 2.0e10)
"""The same for PCIe Gen4 cards without NVLink (L40S, L40, L4, A10)."""
PCIE5 = (2.0e-5, 4.0e10)
"""The same for PCIe Gen5 cards (H100 PCIe, H100/H200 NVL with bridges only between pairs)."""


@dataclass(frozen=True)
class Gpu:
    """One GPU model: its name, its dense peak rates and, if ``launcher.gpu_type`` can name it, what a
    plan for its nodes needs."""

    name: str
    """Device-name fragment, matched (case-insensitively) in ``torch.cuda.get_device_name()``; longer
    fragments win (:func:`gpu_named`), so ``H100 PCIe`` needs no exclusion in ``H100``."""
    tflops: dict[str, float]
    """Dense peak TFLOP/s per rate: ``bf16`` (also ``fp16``), ``tf32`` (fp32 with ``trainer.tf32``) and
    ``fp32`` (:func:`rate_key`)."""
    memory_gib: dict[str, float] = field(default_factory=dict)
    """``launcher.gpu_type`` -> device memory as ``nvidia-smi`` reports it (GiB, rounded down: the data
    sheet less what the driver reserves). Empty: a model only the peak table knows (H800, A800)."""
    link: tuple[float, float] | None = None
    """(latency s, bus bandwidth B/s) of an all-reduce among the GPUs of one node (with gpu_types only)."""
    bf16: bool = True
    """bf16 tensor cores (Ampere and newer); V100 has none (DeepSpeed refuses bf16 there)."""


def _rates(bf16: float, tf32: float, fp32: float) -> dict[str, float]:
    return {"bf16": bf16, "tf32": tf32, "fp32": fp32}


GPUS: tuple[Gpu, ...] = (
    # Peak rates: NVIDIA data sheets, which print tensor-core rates "with sparsity"; the dense rate is
    # half of that. H100/H200 SXM and NVL: "NVIDIA H100 Tensor Core GPU" and "NVIDIA H200 Tensor
    # Core GPU" data sheets (SXM: TF32 989, BF16 1,979 sparse; FP32 67. NVL: TF32 835, BF16 1,671
    # sparse; FP32 60. H100 PCIe: TF32 756, BF16 1,513 sparse; FP32 51). HGX B200: TF32 18 PF,
    # BF16 36 PF sparse for 8 GPUs. GB200 NVL72: TF32 180 PF, BF16 360 PF sparse for 72 GPUs (its
    # plain FP32 is not printed: B200's figure). A100: TF32 156, BF16 312 dense; FP32 19.5. L40S:
    # TF32 183, BF16 362 dense; FP32 91.6. L40: TF32 90.5, BF16 181 dense; FP32 90.5. L4: TF32 60,
    # BF16 121 dense; FP32 30.3. A10: TF32 62.5, BF16 125 dense; FP32 31.2. V100 has no bf16
    # and no TF32: its fp16 tensor-core rate (125) and plain FP32 (15.7).
    # The rows' order is the order of launcher.gpu_type's values.
    Gpu("A100", _rates(312.0, 156.0, 19.5), {"a100-40gb": 40.0, "a100-80gb": 80.0}, NVLINK3),
    Gpu("A800", _rates(312.0, 156.0, 19.5)),
    Gpu("H100", _rates(989.4, 494.7, 66.9), {"h100-80gb": 79.6}, NVLINK4),  # SXM
    Gpu("H100 PCIe", _rates(756.5, 378.0, 51.2), {"h100-pcie": 79.6}, PCIE5),
    Gpu("H100 NVL", _rates(835.5, 417.5, 60.0), {"h100-nvl": 93.5}, PCIE5),
    Gpu("H800", _rates(989.4, 494.7, 66.9)),
    Gpu("H200", _rates(989.4, 494.7, 66.9), {"h200": 140.0}, NVLINK4),  # SXM
    Gpu("H200 NVL", _rates(835.5, 417.5, 60.0), {"h200-nvl": 140.0}, PCIE5),
    Gpu("GH200", _rates(989.4, 494.7, 66.9), {"gh200": 95.5}, NVLINK4),
    Gpu("B200", _rates(2250.0, 1125.0, 80.0), {"b200": 179.0}, NVLINK5),
    Gpu("GB200", _rates(2500.0, 1250.0, 80.0), {"gb200": 184.0}, NVLINK5),
    Gpu("L40S", _rates(362.1, 183.0, 91.6), {"l40s": 44.9}, PCIE4),
    Gpu("L40", _rates(181.0, 90.5, 90.5), {"l40": 44.9}, PCIE4),
    Gpu("L4", _rates(121.0, 60.0, 30.3), {"l4": 22.4}, PCIE4),
    Gpu("A10", _rates(125.0, 62.5, 31.2), {"a10": 22.4}, PCIE4),
    # no bf16, no TF32: the bf16 column is the fp16 tensor-core rate, the tf32 column plain fp32
    Gpu("V100", _rates(125.0, 15.7, 15.7), {"v100-16gb": 15.7, "v100-32gb": 31.7}, NVLINK2, bf16=False),
)
"""Every GPU model hybridtrain knows, the one place its facts are written."""


@dataclass(frozen=True)
class GpuSpec:
    """What the plan needs to know about the GPUs of one ``launcher.gpu_type``."""

    memory_gib: float
    """Device memory as ``nvidia-smi`` reports it (GiB, rounded down)."""
    peak: str
    """Its row of :data:`GPU_PEAK_TFLOPS` (dense peak FLOP/s)."""
    link: tuple[float, float]
    """(latency s, bus bandwidth B/s) of an all-reduce among the GPUs of one node."""
    bf16: bool = True
    """bf16 tensor cores (Ampere and newer); V100 has none (DeepSpeed refuses bf16 there)."""


GPU_PEAK_TFLOPS: dict[str, dict[str, float]] = {gpu.name: gpu.tflops for gpu in GPUS}
"""Dense peak TFLOP/s per GPU model (device-name fragment) and rate (``bf16`` also serves ``fp16``;
``tf32``: fp32 runs with ``trainer.tf32``)."""

GPU_SPECS: dict[str, GpuSpec] = {
    gpu_type: GpuSpec(memory, gpu.name, gpu.link, gpu.bf16)
    for gpu in GPUS for gpu_type, memory in gpu.memory_gib.items()
}
"""``launcher.gpu_type`` -> its :class:`GpuSpec`."""

GPU_TYPES: tuple[str, ...] = tuple(GPU_SPECS)
"""The values of ``launcher.gpu_type`` (:class:`hybridtrain.config.choices.GpuType`), in table order."""


def uses_tf32(precision: str, tf32: bool) -> bool:
    """Whether a GPU run lets fp32 matmuls use TF32: only an fp32 run with ``trainer.tf32``. A bf16/fp16 run's
    remaining fp32 matmuls (routers, rotary tables, the loss) keep full fp32: they are the parts a mixed-precision
    model keeps in fp32 for accuracy (a rotary table computed by a TF32 matmul drifts at long positions)."""
    return precision == "fp32" and tf32


ALLOCATOR_KEYS = ("PYTORCH_ALLOC_CONF", "PYTORCH_CUDA_ALLOC_CONF")
"""The environment variables torch's CUDA caching allocator reads its settings from (the first is torch's
newer name, the second its older one, both honoured by torch 2.13)."""

EXPANDABLE = "expandable_segments:True"
"""The allocator setting a GPU rank gets unless the environment sets the allocator: segments that grow in
place, so the varying ``[rows, H]`` shapes of a dropless MoE dispatch (and of packed rows) reuse memory
instead of fragmenting the cache into blocks of every size (what torchtitan's launch script sets too)."""


def allocator_settings(environ) -> None:
    """Put :data:`EXPANDABLE` into ``environ`` (a GPU rank's ``os.environ``, before CUDA starts) unless one of
    :data:`ALLOCATOR_KEYS` is set already: the user's own allocator settings win, whatever they say."""
    if not any(environ.get(key) for key in ALLOCATOR_KEYS):
        environ[ALLOCATOR_KEYS[1]] = EXPANDABLE


def rate_key(precision: str, tf32: bool = False) -> str:
    """The table column a run's matmuls reach: ``bf16`` (bf16, fp16), ``tf32`` (fp32 with
    ``trainer.tf32``) or ``fp32``."""
    if precision != "fp32":
        return "bf16"
    return "tf32" if uses_tf32(precision, tf32) else "fp32"


def gpu_named(device_name: str) -> Gpu | None:
    """The row whose name occurs in ``device_name`` (case-insensitive; longest names first, so
    ``H100 PCIe`` wins over ``H100`` and ``GH200`` over ``H200``); ``None`` for an unknown GPU."""
    for gpu in sorted(GPUS, key=lambda g: len(g.name), reverse=True):
        if gpu.name.lower() in device_name.lower():
            return gpu
    return None
