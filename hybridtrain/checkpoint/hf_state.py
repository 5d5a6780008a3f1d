"""Gather this rank's shards back into HF-named, unpadded, unsharded tensors.

Each pipeline layer knows the HF name of every parameter it holds and how that parameter was
split (:class:`Split`); :func:`gather` undoes ZeRO partitioning (DeepSpeed's
``safe_get_full_fp32_param``), then tensor parallelism (an all-gather over the TP group,
fused q|k|v aware), then the Conv1D transpose and the vocabulary padding. The result is what
``save_pretrained`` would have written for this stage. Tensors stay on the engine's device
through both collectives (NCCL gathers only device tensors) and reach the host at the end.
"""
from __future__ import annotations

from dataclasses import dataclass
from typing import Callable, Iterator, Optional

import torch
import torch.nn as nn

from hybridtrain.models.families import Family
from hybridtrain.parallel.context import TPContext
from hybridtrain.parallel.layers import ColumnParallelLinear, RowParallelLinear


@dataclass(frozen=True)
class Split:
    """How a local tensor relates to its HF tensor."""

    dim: Optional[int] = None
    """Dimension split over TP in the local ``[out, in]`` layout; ``None``: replicated."""
    fused: int = 1
    """Sub-blocks fused along ``dim`` and split one by one (GPT-2 ``c_attn``: 3)."""
    transpose: bool = False
    """HF stores this weight transposed (``Conv1D``: ``[in, out]``)."""
    vocab: Optional[int] = None
    """Keep only the first ``vocab`` rows (drop the padding added for TP)."""


def block_params(block: nn.Module, prefix: str, family: Family) -> Iterator[tuple[str, nn.Parameter, Split]]:
    """``(hf_name, param, split)`` for every parameter of a sharded HF decoder block."""
    owners = {}
    for path, module in block.named_modules():
        if isinstance(module, (ColumnParallelLinear, RowParallelLinear)):
            owners[path] = (module, family.tp_plan[path])
    for local, param in block.named_parameters():
        owner, _, leaf = local.rpartition(".")
        if owner in owners:
            module, rule = owners[owner]
            if isinstance(module, ColumnParallelLinear):
                split = Split(dim=0, fused=rule.fused, transpose=rule.conv1d and leaf == "weight")
            else:
                split = Split(dim=1, transpose=rule.conv1d) if leaf == "weight" else Split()
        else:
            split = Split()
        yield f"{prefix}.{local}", param, split


def _full_over_dp(param: nn.Parameter) -> torch.Tensor:
    """The fp32 master value of ``param`` with ZeRO partitions reassembled (collective over DP),
    on the parameter's device."""
    from deepspeed.utils import safe_get_full_fp32_param

    full = safe_get_full_fp32_param(param)
    return (full if full is not None else param.detach()).float()


def unshard(shards: list[torch.Tensor], split: Split) -> torch.Tensor:
    """Concatenate TP shards (rank order) into the full local-layout tensor."""
    if split.fused == 1:
        return torch.cat(shards, dim=split.dim)
    parts = [s.chunk(split.fused, dim=split.dim) for s in shards]  # [rank][sub-block]
    return torch.cat([torch.cat([p[k] for p in parts], dim=split.dim) for k in range(split.fused)], dim=split.dim)


def to_hf(tensor: torch.Tensor, split: Split) -> torch.Tensor:
    """Local full layout -> HF layout (transpose, unpad)."""
    if split.vocab is not None:
        tensor = tensor[: split.vocab]
    return tensor.t().contiguous() if split.transpose else tensor.contiguous()


def full_moment(engine, param: nn.Parameter, key: str) -> torch.Tensor:
    """AdamW state ``key`` of ``param`` with ZeRO partitions reassembled (collective over DP), on
    the device."""
    from deepspeed.utils import safe_get_full_optimizer_state

    full = safe_get_full_optimizer_state(param, key)
    if full is None:  # ZeRO-0: the torch optimizer holds the parameter itself
        base = getattr(engine.optimizer, "optimizer", engine.optimizer)
        full = base.state[param][key]
    return full.float()


def gather(named: list[tuple[str, nn.Parameter, Split]], tp: TPContext, device,
           value: Callable[[nn.Parameter], torch.Tensor] | None = None) -> dict[str, torch.Tensor]:
    """HF-named full fp32 tensors of ``named`` on the host (every rank of the stage must call this
    together).

    ``value(param)`` gives the tensor to gather (default: the fp32 master weight); each rank passes
    its own shard, reassembled over DP already. The TP all-gather runs on ``device`` (the engine's);
    each tensor is copied to the host after it, one at a time, so device memory holds one full
    tensor at most.
    """
    from hybridtrain.parallel import collectives

    out: dict[str, torch.Tensor] = {}
    for name, param, split in named:
        local = (value or _full_over_dp)(param)
        if split.dim is not None and tp.size > 1:
            local = unshard(collectives.all_gather(local, device, group=tp.group), split)
        out[name] = to_hf(local.cpu(), split)
    return out
