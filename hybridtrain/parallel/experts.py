"""Tensor parallelism of transformers' fused 3-D experts module (the ``experts`` style of
:mod:`hybridtrain.parallel.tensor`).

transformers keeps a mixture-of-experts layer's routed experts in one module (``Qwen3MoeExperts``,
``MixtralExperts``, ...) holding ``gate_up_proj [E, 2I, H]`` (gate | up fused along dim 1) and
``down_proj [E, H, I]``, whose forward is picked by ``config._experts_implementation`` (``grouped_mm`` by
default, also on CPU). Each rank keeps its slice of every expert's MLP width ``I`` (gate and up halves
sliced each on its own) and runs that same HF forward on the slices: each expert's SwiGLU is
element-wise in ``I``, so the rank's output is its partial sum of the full output, and one all-reduce
over the TP group ("g") completes it. Both float inputs get Megatron's "f" (identity forward,
all-reduce backward): the hidden states routed to the experts and the top-k weights, since a rank's
partial output gives them partial gradients. The router stays outside this region (replicated, full
gradients on every rank), so nothing else in the block is all-reduced.

The parameters keep their HF names and layout (only their ``I`` dimension shrinks) and are tagged like
every TP shard (``tensor_model_parallel``, ``partition_dim``) so DeepSpeed's gradient norm counts each
shard once.
"""
from __future__ import annotations

from typing import Mapping, Optional

import torch
import torch.nn as nn

from hybridtrain.parallel.context import TPContext
from hybridtrain.parallel.layers import copy_to_tp, reduce_from_tp, tag_sharded
from hybridtrain.parallel.slicing import Split, local_part

EXPERTS_INPUTS = ("hidden_states", "top_k_index", "top_k_weights")
"""The experts module's forward arguments, in transformers' order (every ``*Experts.forward``)."""


def shard_experts(module: nn.Module, splits: Mapping[str, Split], tp: TPContext, read=None) -> nn.Module:
    """Keep this rank's slice of ``module``'s fused expert weights (``splits``: leaf -> :class:`Split` in
    HF layout), cut from the module or, with ``read(leaf, dim, fused)``, read from a checkpoint; with
    tp > 1 wrap its forward in "f" on the float inputs and "g" on the output. Returns ``module`` itself
    (its parameter names stay HF's)."""
    for leaf, split in splits.items():
        full = getattr(module, leaf)
        want = list(full.shape)
        want[split.dim] //= tp.size
        if read is not None:
            part = read(leaf, split.dim, split.fused)
        else:
            part = local_part(full.detach(), split, tp.rank, tp.size)
        if list(part.shape) != want:
            raise ValueError(f"experts shard {leaf} of shape {tuple(part.shape)} does not fit the configured "
                             f"model's {tuple(want)}; the model config does not match the checkpoint")
        param = nn.Parameter(part.to(full.dtype).contiguous(), requires_grad=full.requires_grad)
        setattr(module, leaf, tag_sharded(param, split.dim) if tp.size > 1 else param)
    if hasattr(module, "intermediate_dim"):
        module.intermediate_dim //= tp.size
    if tp.size > 1:
        module.register_forward_pre_hook(_CopyExpertInputs(tp), with_kwargs=True)
        module.register_forward_hook(_ReduceExpertOutput(tp))
    return module


class _CopyExpertInputs:
    """Forward pre-hook: "f" on the experts' hidden states and top-k weights (positional or keyword)."""

    def __init__(self, tp: TPContext):
        self.tp = tp

    def __call__(self, module, args, kwargs):
        args, kwargs = list(args), dict(kwargs)
        for i, name in enumerate(EXPERTS_INPUTS):
            if name == "top_k_index":
                continue
            if i < len(args):
                args[i] = copy_to_tp(args[i], self.tp)
            elif name in kwargs:
                kwargs[name] = copy_to_tp(kwargs[name], self.tp)
        return tuple(args), kwargs


class _ReduceExpertOutput:
    """Forward hook: "g", the sum of the ranks' partial expert outputs."""

    def __init__(self, tp: TPContext):
        self.tp = tp

    def __call__(self, module, args, output: torch.Tensor) -> Optional[torch.Tensor]:
        return reduce_from_tp(output, self.tp)
