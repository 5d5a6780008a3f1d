"""Gather this rank's shards back into HF-named, unpadded, unsharded tensors.

Each pipeline layer knows the HF name of every parameter it holds and how that parameter was
split (:class:`~hybridtrain.parallel.slicing.Split`); :func:`gathered` undoes ZeRO partitioning (DeepSpeed's
``safe_get_full_fp32_param``), then expert parallelism (an MoE layer's experts gathered over the
expert-parallel group, concatenated along their leading dimension), then tensor parallelism (a gather over
the TP group, fused q|k|v aware), then the Conv1D transpose and the vocabulary padding. The result is what
``save_pretrained`` would have written for this stage, one tensor at a time and on the writing rank
only (:func:`gathered`). Tensors stay on the engine's device through both collectives (NCCL gathers
only device tensors) and reach the host at the end.
"""
from __future__ import annotations

from typing import Callable, Iterator, Optional

import torch
import torch.nn as nn

from hybridtrain.models.families import Family, fused_sizes
from hybridtrain.models.lora import LORA_A, LORA_B
from hybridtrain.parallel.context import EPContext, TPContext
from hybridtrain.parallel.slicing import Split, block_sizes


def block_params(block: nn.Module, prefix: str, family: Family, hf_config,
                 variant: Optional[str] = None) -> Iterator[tuple[str, nn.Parameter, Split]]:
    """``(hf_name, param, split)`` for every parameter of a sharded HF decoder block of ``variant``, by the
    family's tensor-parallel plan of that variant (``hf_config`` gives the sizes of fused sub-blocks)."""
    plan = family.plan_of(variant)
    for local, param in block.named_parameters():
        owner, _, leaf = local.rpartition(".")
        linear, _, matrix = owner.rpartition(".")
        if matrix in (LORA_A, LORA_B):  # an adapter: A [r, in], B [out, r], cut like the layer's weight
            rule = plan[linear]
            a, b = rule.tp_style.lora_splits(fused_sizes(rule, family, hf_config))
            yield f"{prefix}.{local}", param, a if matrix == LORA_A else b
            continue
        rule = plan.get(owner)
        split = Split() if rule is None else rule.tp_style.split(leaf, rule.conv1d, fused_sizes(rule, family, hf_config))
        yield f"{prefix}.{local}", param, split


def _full_over_dp(param: nn.Parameter) -> torch.Tensor:
    """The fp32 master value of ``param`` with ZeRO partitions reassembled (collective over DP),
    on the parameter's device."""
    from deepspeed.utils import safe_get_full_fp32_param

    full = safe_get_full_fp32_param(param)
    if full is None and hasattr(param, "ds_id"):  # ZeRO-3 without optimizer state (a frozen LoRA base): gather
        from deepspeed.runtime.zero import GatheredParameters  # deepspeed.zero is an attribute, not a module

        with GatheredParameters([param]):
            return param.detach().float().clone()
    return (full if full is not None else param.detach()).float()


def unshard(shards: list[torch.Tensor], split: Split) -> torch.Tensor:
    """Concatenate TP shards (rank order) into the full local-layout tensor, fused sub-block by
    sub-block (the inverse of :func:`hybridtrain.parallel.slicing.shard_tensor`)."""
    if split.fused == 1:
        return torch.cat(shards, dim=split.dim)
    size = len(shards)
    local = block_sizes(shards[0].shape[split.dim] * size, split.fused)  # full sub-block sizes
    parts = [s.split([b // size for b in local], dim=split.dim) for s in shards]  # [rank][sub-block]
    return torch.cat([torch.cat([p[k] for p in parts], dim=split.dim) for k in range(len(local))], dim=split.dim)


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


def hf_shape(param: nn.Parameter, split: Split, tp_size: int, ep_size: int = 1) -> tuple[int, ...]:
    """The shape :func:`gathered` gives ``param`` (its TP shard's shape, ZeRO-3's ``ds_shape`` where
    partitioned): joined over TP along ``split.dim`` and, for an MoE layer's experts, over the ``ep_size``
    expert-parallel ranks along dim 0, the vocabulary padding cut, transposed for ``Conv1D``; known before
    anything is gathered."""
    shape = list(getattr(param, "ds_shape", None) or param.shape)
    if split.dim is not None and tp_size > 1:
        shape[split.dim] *= tp_size
    if split.experts and ep_size > 1:
        shape[0] *= ep_size
    if split.vocab is not None:
        shape[0] = min(shape[0], split.vocab)
    return tuple(shape[::-1] if split.transpose else shape)


def gathered(named: list[tuple[str, nn.Parameter, Split]], tp: TPContext, device, gathers: bool,
             value: Callable[[nn.Parameter], torch.Tensor] | None = None, ep: EPContext | None = None,
             ep_gathers: bool = False) -> Iterator[tuple[str, torch.Tensor | None]]:
    """``(hf_name, tensor)`` for each of ``named`` in turn: the HF-named full fp32 tensor on the host at
    TP rank 0 of a ``gathers`` group, ``None`` on every other rank (every rank of the stage iterates
    it together).

    ``value(param)`` gives the tensor to gather (default: the fp32 master weight), reassembled over DP
    already (a collective every data-parallel rank joins; for expert parameters DeepSpeed's expert-data
    group). An MoE layer's experts (``split.experts``) with ``ep.size > 1`` are then gathered over the
    expert-parallel group ``ep`` to its rank 0 (the ranks of the writer's group, ``ep_gathers``: data ranks
    ``0 .. ep - 1``, each holding other experts), which joins them along dim 0 (``[E / ep, ...]`` x ep ->
    ``[E, ...]``). Only the TP group that writes (``gathers``: data-parallel rank 0, expert-parallel rank 0
    of that group) then gathers it, to its TP rank 0 alone: the other ranks hold their own shard and nothing
    more, and the receiving rank one full tensor on ``device`` (the engine's), moved to the host shard by
    shard before it is joined there. So the host holds one tensor at a time, on one rank.
    """
    from hybridtrain.parallel import collectives

    for name, param, split in named:
        local = (value or _full_over_dp)(param)
        if split.experts and ep is not None and ep.size > 1:
            if not ep_gathers:  # another expert-parallel group: the writer's holds the same experts
                del local
                yield name, None
                continue
            shards = collectives.gather(local, device, group=ep.group)  # the ep slices, in expert order
            del local
            if shards is None:
                yield name, None
                continue
            local = torch.cat(shards, dim=0)  # [E / ep, ...] x ep -> [E, ...]
            del shards
        if not gathers:
            del local
            yield name, None
            continue
        if split.dim is not None and tp.size > 1:
            shards = collectives.gather(local, device, group=tp.group)
            del local
            if shards is None:
                yield name, None
                continue
            host = []
            while shards:  # each shard leaves the device before the next is copied
                host.append(shards.pop(0).cpu())
            full = unshard(host, split)
            del host
        elif tp.rank == 0:
            full = local.cpu()
        else:
            yield name, None
            continue
        yield name, to_hf(full, split)
        del full
