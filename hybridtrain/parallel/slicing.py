"""Which part of a full (HF-layout) tensor a tensor-parallel rank holds: one definition of the index
math, used when sharding a built model, reading a checkpoint slice by slice, and re-sharding.

A dimension of length ``n`` holding ``fused`` equal sub-blocks (GPT-2's ``c_attn`` = q | k | v: 3)
is split sub-block by sub-block: rank ``r`` of ``size`` keeps chunk ``r`` of each, so every rank gets
matching q, k and v heads. :func:`hybridtrain.checkpoint.hf_state.merge` is the inverse.
"""
from __future__ import annotations


def shard_ranges(length: int, fused: int, rank: int, size: int) -> list[tuple[int, int]]:
    """``[lo, hi)`` ranges (one per fused sub-block) of rank ``rank`` along a dimension of ``length``."""
    part = length // fused
    chunk = part // size
    return [(j * part + rank * chunk, j * part + (rank + 1) * chunk) for j in range(fused)]


def shard_tensor(tensor, dim: int, fused: int, rank: int, size: int):
    """Rank ``rank``'s part of ``tensor`` along ``dim`` (contiguous)."""
    import torch

    ranges = shard_ranges(tensor.shape[dim], fused, rank, size)
    return torch.cat([tensor.narrow(dim, lo, hi - lo) for lo, hi in ranges], dim=dim).contiguous()
