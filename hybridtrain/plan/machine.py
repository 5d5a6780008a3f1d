"""Facts about the machine a plan is made on (read at the launch boundary)."""
from __future__ import annotations

from hybridtrain.plan.types import Machine


def machine_facts() -> Machine:
    """What this node offers: CUDA GPUs, fp16 and bf16 support, CPU cores, device memory (``launcher=local``
    plans with it; a cluster launcher's plan does not look here, :mod:`hybridtrain.plan.devices`)."""
    import os

    import torch

    gpus = torch.cuda.device_count() if torch.cuda.is_available() else 0
    if gpus:
        fp16 = True
    else:  # DeepSpeed's CPU accelerator allows fp16 only with mkldnn fp16 kernels
        fp16 = bool(getattr(torch.ops.mkldnn, "_is_mkldnn_fp16_supported", lambda: False)())
    if gpus:
        memory = int(torch.cuda.get_device_properties(0).total_memory)
    else:
        try:
            memory = os.sysconf("SC_PAGE_SIZE") * os.sysconf("SC_PHYS_PAGES")
        except (ValueError, OSError, AttributeError):
            memory = 0
    bf16 = bool(torch.cuda.is_bf16_supported()) if gpus else True  # DeepSpeed's CPU accelerator has bf16
    return Machine(gpus_per_node=gpus, fp16_supported=fp16, cpu_cores=os.cpu_count() or 1,
                   device_memory_bytes=int(memory), bf16_supported=bf16)
