"""The devices a plan is made for, and the defaults that follow from them.

``launcher=local`` plans for this machine (:func:`hybridtrain.plan.machine.machine_facts`). The ranks of
``launcher=slurm`` and ``multinode`` run on other machines, so their plan never reads the machine the
command runs on (a login node without GPUs, a laptop): the device facts come from the launcher's keys,
``launcher.gpus`` and ``launcher.gpu_type``, and the table of known GPUs below (:func:`planned_machine`).

From the devices follow the defaults the plan resolves: the precision (:func:`precision_for`), the
vocabulary padding (:func:`hybridtrain.plan.validate.vocab_pad_multiple`) and the memory budget
(:func:`memory_budget`, with the headroom GPUs need).
"""
from __future__ import annotations

from dataclasses import dataclass

from hybridtrain.observe.peak import GPU_PEAK_TFLOPS, rate_key
from hybridtrain.plan.types import Machine

GiB = 2**30
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
class GpuSpec:
    """What the plan needs to know about a GPU model."""

    memory_gib: float
    """Device memory as ``nvidia-smi`` reports it (GiB, rounded down)."""
    peak: str
    """Its row of :data:`hybridtrain.observe.peak.GPU_PEAK_TFLOPS` (dense peak FLOP/s)."""
    link: tuple[float, float]
    """(latency s, bus bandwidth B/s) of an all-reduce among the GPUs of one node."""
    bf16: bool = True
    """bf16 tensor cores (Ampere and newer); V100 has none (DeepSpeed refuses bf16 there)."""


GPU_SPECS: dict[str, GpuSpec] = {
    "a100-40gb": GpuSpec(40.0, "A100", NVLINK3),
    "a100-80gb": GpuSpec(80.0, "A100", NVLINK3),
    "h100-80gb": GpuSpec(79.6, "H100", NVLINK4),
    "h100-pcie": GpuSpec(79.6, "H100 PCIe", PCIE5),
    "h100-nvl": GpuSpec(93.5, "H100 NVL", PCIE5),
    "h200": GpuSpec(140.0, "H200", NVLINK4),
    "h200-nvl": GpuSpec(140.0, "H200 NVL", PCIE5),
    "gh200": GpuSpec(95.5, "GH200", NVLINK4),
    "b200": GpuSpec(179.0, "B200", NVLINK5),
    "gb200": GpuSpec(184.0, "GB200", NVLINK5),
    "l40s": GpuSpec(44.9, "L40S", PCIE4),
    "l40": GpuSpec(44.9, "L40", PCIE4),
    "l4": GpuSpec(22.4, "L4", PCIE4),
    "a10": GpuSpec(22.4, "A10", PCIE4),
    "v100-16gb": GpuSpec(15.7, "V100", NVLINK2, bf16=False),
    "v100-32gb": GpuSpec(31.7, "V100", NVLINK2, bf16=False),
}
"""``launcher.gpu_type`` -> its :class:`GpuSpec` (memory from the data sheets, less what the driver
reserves; every key is a value of :class:`hybridtrain.config.choices.GpuType`)."""

CLUSTER_LAUNCHERS = ("slurm", "multinode")
"""Launchers whose ranks run on other machines than the command (their plan reads no local device)."""


def is_cluster(launcher) -> bool:
    """Whether ``launcher``'s ranks run on other machines than this command (``slurm``, ``multinode``)."""
    return str(launcher.name) in CLUSTER_LAUNCHERS


def gpu_spec(launcher) -> GpuSpec | None:
    """The :class:`GpuSpec` of ``launcher.gpu_type`` (cluster launchers only), or ``None``."""
    name = getattr(launcher, "gpu_type", None)
    return GPU_SPECS[str(name)] if name is not None else None


def uses_gpus(launcher, machine: Machine) -> bool:
    """Whether the ranks run on GPUs: ``launcher.gpus`` when set; else on a cluster whether
    ``launcher.gpu_type`` names the nodes' GPUs, and with ``launcher=local`` whether this machine has
    CUDA devices (``machine``)."""
    if launcher.gpus is not None:
        return bool(launcher.gpus)
    if is_cluster(launcher):
        return gpu_spec(launcher) is not None
    return machine.gpus_per_node > 0


def planned_machine(launcher, here: Machine) -> Machine:
    """The device facts a plan for ``launcher`` is made with: ``here`` (this machine) for ``local`` (GPUs
    asked for with ``launcher.gpus=true`` where there are none, e.g. a dry run of a GPU recipe on a
    laptop: GPUs of unknown memory); for a cluster launcher the nodes as its keys describe them: GPUs of ``launcher.gpu_type`` (memory, bf16
    support; fp16 always), or with GPUs of unknown type unknown memory; CPU nodes of unknown memory and
    cores, whose fp16 support is assumed to be this machine's (hybridtrain cannot ask them)."""
    if not is_cluster(launcher):
        if uses_gpus(launcher, here) and not here.gpus_per_node:  # launcher.gpus=true planned on a GPU-less machine
            return Machine(gpus_per_node=0, fp16_supported=True, cpu_cores=here.cpu_cores, device_memory_bytes=0)
        return here
    per_node = launcher.gpus_per_node or 0
    if uses_gpus(launcher, here):
        spec = gpu_spec(launcher)
        return Machine(gpus_per_node=per_node, fp16_supported=True, bf16_supported=spec.bf16 if spec else True,
                       cpu_cores=0, device_memory_bytes=int(spec.memory_gib * GiB) if spec else 0,
                       gpu_type=str(launcher.gpu_type) if spec else None)
    return Machine(gpus_per_node=0, fp16_supported=here.fp16_supported, bf16_supported=True, cpu_cores=0,
                   device_memory_bytes=0)


def precision_for(asked, launcher, machine: Machine) -> str:
    """``trainer.precision``, or for ``null`` ``bf16`` when the ranks run on GPUs with bf16 support and
    ``fp32`` otherwise (CPU processes; V100, whose users choose fp16 themselves)."""
    if asked is not None:
        return str(asked)
    return "bf16" if uses_gpus(launcher, machine) and machine.bf16_supported else "fp32"


def memory_budget(plan_cfg, launcher, machine: Machine, ranks_per_node: int) -> int:
    """Bytes one rank may plan for (0: unknown, no limit).

    The device's memory is ``plan.device_memory_gb``, else a GPU's memory (this machine's, or
    ``launcher.gpu_type``'s on a cluster), else for ``launcher=local`` CPU processes the machine's RAM
    divided by ``ranks_per_node``. On GPUs the budget keeps ``plan.memory_headroom`` of it and
    ``plan.memory_reserved_gb`` free for the CUDA context, NCCL buffers and fragmentation."""
    gpus = uses_gpus(launcher, machine)
    if plan_cfg.device_memory_gb is not None:
        memory = int(plan_cfg.device_memory_gb * GiB)
    elif gpus or machine.gpus_per_node:
        memory = machine.device_memory_bytes
    else:
        memory = machine.device_memory_bytes // max(1, ranks_per_node)
    if not gpus or not memory:
        return memory
    return max(0, int((1 - plan_cfg.memory_headroom) * memory - plan_cfg.memory_reserved_gb * GiB))


def gpu_peak_flops(spec: GpuSpec, precision: str, tf32: bool) -> float:
    """Dense peak FLOP/s of ``spec`` for ``precision`` (fp32 with ``trainer.tf32``: the TF32 rate)."""
    return GPU_PEAK_TFLOPS[spec.peak][rate_key(precision, tf32)] * 1e12

