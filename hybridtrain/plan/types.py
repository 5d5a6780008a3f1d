"""The plan's value types: what a validated run looks like (:class:`Plan`) and the machine facts it was
planned for (:class:`Machine`). The bottom of :mod:`hybridtrain.plan`: no rules, no imports of the planner."""
from __future__ import annotations

from dataclasses import asdict, dataclass, field
from typing import Any

from hybridtrain.parallel.dims import AXES, BatchLayout, ParallelDims, pipeline_bubble


@dataclass(frozen=True)
class Machine:
    """Facts about where the job runs, gathered at the launch boundary."""

    gpus_per_node: int = 0
    """CUDA devices visible on this node (0: CPU processes)."""
    fp16_supported: bool = True
    """Whether the device can train in fp16 (DeepSpeed refuses fp16 on most CPUs)."""
    cpu_cores: int = 1
    """CPU cores of a node; 0: unknown (a cluster's nodes)."""
    device_memory_bytes: int = 0
    """Memory of one device (GPU 0), or on CPU the machine's RAM; 0: unknown."""
    bf16_supported: bool = True
    """Whether the device trains in bf16 (CPUs and Ampere or newer GPUs; not V100)."""
    gpu_type: str | None = None
    """``launcher.gpu_type`` of a cluster's nodes (:data:`hybridtrain.plan.devices.GPU_SPECS`)."""


@dataclass
class Plan:
    """The resolved parallel layout of a run (saved next to ``config.yaml`` as ``plan.json``, where the degrees
    of :attr:`dims` are top-level keys: ``{"pp": 2, "dp": 1, "cp": 1, "tp": 2, "world_size": 4, ...}``)."""

    dims: ParallelDims
    """The degrees of every parallel axis (:mod:`hybridtrain.parallel.dims`)."""
    world_size: int
    nodes: int
    micro_batch_size: int
    grad_accum: int
    global_batch_size: int
    zero_stage: int
    precision: str
    seq_len: int
    tokens_per_step: int
    vocab_size: int
    padded_vocab_size: int
    num_layers: int
    layer_names: list[str] = field(default_factory=list)
    """Pipeline layers in order (``embed``, ``pos_embed``, ``block.0``..., ``final_norm``, ``head``)."""
    stage_bounds: list[int] = field(default_factory=list)
    """Stage ``s`` holds ``layer_names[stage_bounds[s]:stage_bounds[s+1]]``."""
    partition_method: str = ""
    """How ``stage_bounds`` were chosen: the ``parallel.partition`` method, or ``manual`` when
    ``parallel.stage_layers`` gave them; empty in a ``plan.json`` written before it was recorded."""
    gpus: bool = False
    """Whether the ranks run on GPUs (:func:`~hybridtrain.plan.devices.uses_gpus`): which kernels sdpa picks, so
    what the attention keeps (:func:`~hybridtrain.plan.memory.attention_flags`). A ``plan.json`` predating it:
    ``False``."""

    def stage_layers(self, stage: int) -> list[str]:
        """Pipeline layer names of ``stage``."""
        return self.layer_names[self.stage_bounds[stage]:self.stage_bounds[stage + 1]]

    def batch_layout(self) -> BatchLayout:
        """How each global batch is divided over the ranks (:class:`~hybridtrain.parallel.dims.BatchLayout`)."""
        return self.dims.batch_layout(self.global_batch_size, self.micro_batch_size)

    @property
    def bubble(self) -> float:
        """The pipeline's idle share of a step in theory, ``(pp - 1) / (m + pp - 1)`` with ``m = grad_accum``."""
        return pipeline_bubble(self.dims.pp, self.grad_accum)

    def layout(self) -> dict[str, Any]:
        """What a checkpoint must match to be loaded with DeepSpeed's own state (``meta.json`` ``plan``):
        every axis's degree and the ZeRO stage (compare saved layouts through :func:`saved_layout`).

        With pp > 1 the stage boundaries too: each stage's ZeRO flat buffers hold its own layers. With
        ``parallel.ep`` > 1 its degree (``ep``; absent at 1, so layouts saved before it compare equal).
        """
        out: dict[str, Any] = {**self.dims.degrees(), "zero_stage": self.zero_stage}
        if self.dims.ep > 1:
            out["ep"] = self.dims.ep
        if self.dims.pp > 1:
            out["stage_bounds"] = list(self.stage_bounds)
        return out

    def to_dict(self) -> dict[str, Any]:
        """``plan.json``'s content: the fields, with the degrees of :attr:`dims` as top-level keys."""
        out = asdict(self)
        dims = out.pop("dims")
        return {**{axis: dims[axis] for axis in AXES}, "ep": dims["ep"], **out}

    @classmethod
    def from_dict(cls, data: dict[str, Any]) -> "Plan":
        """The plan of a ``plan.json`` (an axis a file predating it lacks has degree 1)."""
        data = dict(data)
        dims = ParallelDims(**{axis: int(data.pop(axis, 1)) for axis in (*AXES, "ep")})
        return cls(dims=dims, **data)


def saved_layout(saved: dict[str, Any]) -> dict[str, Any]:
    """A checkpoint's saved :meth:`Plan.layout`, with the axes a checkpoint predating them lacks at degree 1,
    so that it compares equal to the same layout today."""
    return {**saved, **{axis: 1 for axis in AXES if axis not in saved}}
