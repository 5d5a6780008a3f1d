"""Which part of a full (HF-layout) tensor a tensor-parallel rank holds: one definition of the index
math, used when sharding a built model, reading a checkpoint slice by slice, and re-sharding.

A dimension may hold fused sub-blocks: ``fused`` equal ones (GPT-2's ``c_attn`` = q | k | v: 3) or
blocks of the given sizes (Phi-3's ``qkv_proj`` = q | k | v with fewer KV heads). It is split block by
block: rank ``r`` of ``size`` keeps chunk ``r`` of each, so every rank gets matching q, k and v heads.
:func:`hybridtrain.checkpoint.hf_state.unshard` is the inverse. :class:`Split` records, for one local
tensor, which dimension is split this way, whether its leading dimension is also split over the experts
(``parallel.ep``: contiguous runs of experts, no fusing) and how HF stores it (checkpoints, re-sharding).
"""
from __future__ import annotations

from dataclasses import dataclass
from typing import Optional, Sequence, Union

Fused = Union[int, Sequence[int]]
"""``n`` equal sub-blocks, or the sub-block sizes."""


def block_sizes(length: int, fused: Fused) -> list[int]:
    """The sub-block sizes of a dimension of ``length`` holding ``fused`` blocks."""
    if isinstance(fused, int):
        return [length // fused] * fused
    sizes = [int(s) for s in fused]
    assert sum(sizes) == length, f"fused blocks {sizes} do not add up to {length}"
    return sizes


def shard_ranges(length: int, fused: Fused, rank: int, size: int) -> list[tuple[int, int]]:
    """``[lo, hi)`` ranges (one per fused sub-block) of rank ``rank`` along a dimension of ``length``."""
    out, start = [], 0
    for block in block_sizes(length, fused):
        chunk = block // size
        out.append((start + rank * chunk, start + (rank + 1) * chunk))
        start += block
    return out


def shard_tensor(tensor, dim: int, fused: Fused, rank: int, size: int):
    """Rank ``rank``'s part of ``tensor`` along ``dim`` (contiguous)."""
    import torch

    ranges = shard_ranges(tensor.shape[dim], fused, rank, size)
    return torch.cat([tensor.narrow(dim, lo, hi - lo) for lo, hi in ranges], dim=dim).contiguous()


@dataclass(frozen=True)
class Split:
    """How a local tensor relates to its HF tensor."""

    dim: Optional[int] = None
    """Dimension split over TP in the local ``[out, in]`` layout; ``None``: replicated."""
    fused: Union[int, tuple[int, ...]] = 1
    """Sub-blocks fused along ``dim`` and split one by one: ``n`` equal ones (GPT-2 ``c_attn``: 3) or
    their sizes in the full tensor (Phi-3 ``qkv_proj``: q, k, v widths)."""
    transpose: bool = False
    """HF stores this weight transposed (``Conv1D``: ``[in, out]``)."""
    vocab: Optional[int] = None
    """Keep only the first ``vocab`` rows (drop the padding added for TP)."""
    experts: bool = False
    """Dimension 0 lists an MoE layer's routed experts, split over ``parallel.ep`` (expert-parallel rank ``r``
    holds experts ``[r E / ep, (r + 1) E / ep)``, each still split along :attr:`dim` over TP)."""


def local_part(tensor, split: Split, rank: int, size: int):
    """Rank ``rank``'s part of the full local-layout ``tensor`` as ``split`` cuts it: its shard along
    ``split.dim``, or a copy of the whole tensor where it is replicated."""
    return shard_tensor(tensor, split.dim, split.fused, rank, size) if split.dim is not None else tensor.clone()
