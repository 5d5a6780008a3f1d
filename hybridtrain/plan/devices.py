"""The devices a plan is made for, and the defaults that follow from them.

``launcher=local`` plans for this machine (:func:`hybridtrain.plan.machine.machine_facts`). The ranks of
``launcher=slurm`` and ``multinode`` run on other machines, so their plan never reads the machine the
command runs on (a login node without GPUs, a laptop): the device facts come from the launcher's keys,
``launcher.gpus`` and ``launcher.gpu_type``, and the table of known GPUs, :mod:`hybridtrain.gpus`
(:func:`planned_machine`).

From the devices follow the defaults the plan resolves: the precision (:func:`precision_for`), the
vocabulary padding (:func:`hybridtrain.plan.validate.vocab_pad_multiple`) and the memory budget
(:func:`memory_budget`, with the headroom GPUs need).
"""
from __future__ import annotations

from hybridtrain.gpus import GPU_PEAK_TFLOPS, GPU_SPECS, GpuSpec, rate_key
from hybridtrain.plan.types import Machine

GiB = 2**30


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
    from hybridtrain.errors import PlanError

    gpus = uses_gpus(launcher, machine)
    given = plan_cfg.device_memory_gb
    if given is not None and not given > 0:
        raise PlanError("plan.device_memory_gb", f"must be > 0 (GiB of one device), got {given}; leave it null "
                        "to use the GPU's (or the machine's) own")
    if given is not None:
        memory = int(given * GiB)
    elif gpus or machine.gpus_per_node:
        memory = machine.device_memory_bytes
    else:
        memory = machine.device_memory_bytes // max(1, ranks_per_node)
    if not gpus or not memory:
        return memory
    budget = int((1 - plan_cfg.memory_headroom) * memory - plan_cfg.memory_reserved_gb * GiB)
    if budget <= 0:  # 0 would read as "unknown memory, no limit"
        raise PlanError("plan.device_memory_gb", f"{memory / GiB:g} GiB leaves no budget after plan.memory_headroom="
                        f"{plan_cfg.memory_headroom:g} ({plan_cfg.memory_headroom * memory / GiB:.2f} GiB) and "
                        f"plan.memory_reserved_gb={plan_cfg.memory_reserved_gb:g} kept free; give one GPU's real "
                        "memory, or lower plan.memory_reserved_gb")
    return budget


def gpu_peak_flops(spec: GpuSpec, precision: str, tf32: bool) -> float:
    """Dense peak FLOP/s of ``spec`` for ``precision`` (fp32 with ``trainer.tf32``: the TF32 rate)."""
    return GPU_PEAK_TFLOPS[spec.peak][rate_key(precision, tf32)] * 1e12

