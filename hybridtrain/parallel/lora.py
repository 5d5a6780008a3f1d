"""LoRA on the tensor-parallel linear layers, without gathering a full weight.

peft's LoRA on a linear layer is ``y = W x + b + s B (A dropout(x))`` with ``A`` ``[r, in]``, ``B``
``[out, r]`` and ``s`` the scaling. Split over the TP group like the layer it adapts:

* **column-parallel** (``W_r`` ``[out/tp, in]``, input replicated after Megatron's "f"): ``A`` is
  replicated, ``B_r`` holds the same output rows as ``W_r`` (fused sub-blocks split one by one, like
  the weight). ``y_r = W_r x + b_r + s B_r (A x)``. The input gradient ``s A^T B_r^T dy_r`` is partial
  and the block's "f" sums it with the base term; ``A``'s gradient ``s (B_r^T dy_r) x^T`` is partial too
  and is summed over the TP group as autograd produces it (an ``[r, in]`` all-reduce per backward).
* **replicated** (a linear outside the TP region, e.g. Qwen2-MoE's ``shared_expert_gate``): plain peft LoRA,
  ``A`` and ``B`` whole on every rank, no collective.
* **row-parallel** (``W_r`` ``[out, in/tp]``, input split): ``A_r`` holds the same input columns as
  ``W_r``, ``B`` is replicated. ``h = sum_r A_r x_r`` needs the all-reduce ``y`` needs anyway, so both
  partial sums travel in one: ``[W_r x_r | A_r x_r]`` ``[B, S, out + r]`` is all-reduced (Megatron "g":
  identity backward), then ``y = . + b + s B h`` on every rank alike. Every gradient is then exact on
  its own rank: ``B``'s from the full ``h`` and the (replicated) output gradient, ``A_r``'s and the
  input's from ``s B^T dy``.

The LoRA matrices sit in ``lora_A.weight`` / ``lora_B.weight``, peft's names. Sharded ones carry the
DeepSpeed grad-norm tags like the base weight; replicated ones stay untagged.

Dropout (``p > 0``) masks the adapter's input as peft does. Every rank of a TP group draws from the
same RNG state (all ranks seed ``trainer.seed`` and run the same operations), so a column-parallel
layer's peers draw one mask for their shared input, and a row-parallel layer draws the mask of the
whole input and keeps its columns: the masks a single process would draw for the full input. The
draws differ from peft's own (other operations consume the RNG in between), so runs with dropout are
not step-for-step equal to peft's.
"""
from __future__ import annotations

import math
from contextlib import contextmanager
from typing import Iterator

import torch
import torch.nn as nn
import torch.nn.functional as F

from hybridtrain.parallel.context import TPContext
from hybridtrain.parallel.layers import (ColumnParallelLinear, RowParallelLinear, reduce_from_tp, sum_grad_over_tp,
                                         tag_sharded)


class LoraMatrix(nn.Module):
    """One LoRA matrix as ``weight`` (so its parameter is ``lora_A.weight`` / ``lora_B.weight``, as peft's)."""

    def __init__(self, weight: torch.Tensor):
        super().__init__()
        self.weight = nn.Parameter(weight)


def initial_a(seed: int, r: int, in_features: int) -> torch.Tensor:
    """peft's initial ``A`` ``[r, in]``: ``kaiming_uniform_(a=sqrt(5))`` (``nn.Linear``'s default), drawn
    under a forked RNG seeded by ``seed`` so every layout (and the peft reference) gets the same matrix."""
    a = torch.empty(r, in_features)
    with torch.random.fork_rng(devices=[]):
        torch.manual_seed(seed)
        nn.init.kaiming_uniform_(a, a=math.sqrt(5))
    return a


def _dropout_mask(shape, p: float, like: torch.Tensor) -> torch.Tensor:
    return torch.empty(shape, dtype=like.dtype, device=like.device).bernoulli_(1 - p).div_(1 - p)


class LoraColumnParallelLinear(ColumnParallelLinear):
    """A :class:`ColumnParallelLinear` with a LoRA adapter: ``A`` ``[r, in]`` replicated (gradient summed
    over TP), ``B_r`` ``[out/tp, r]`` this rank's output rows. Input: already through Megatron's "f"."""

    def __init__(self, base: ColumnParallelLinear, a: torch.Tensor, b: torch.Tensor, scaling: float, dropout: float,
                 tp: TPContext):
        nn.Module.__init__(self)
        self.weight, self.bias = base.weight, base.bias
        self.lora_A = LoraMatrix(a)
        self.lora_B = LoraMatrix(b)
        tag_sharded(self.lora_B.weight, 0)
        sum_grad_over_tp(self.lora_A.weight, tp)
        self.scaling = scaling
        self.dropout = dropout

    def forward(self, x: torch.Tensor) -> torch.Tensor:  # [B, S, in] -> [B, S, out/tp]
        y = super().forward(x)
        if self.dropout and self.training:
            x = x * _dropout_mask(x.shape, self.dropout, x)  # same mask on every TP peer (shared RNG state)
        return y + F.linear(F.linear(x, self.lora_A.weight), self.lora_B.weight) * self.scaling


class LoraRowParallelLinear(RowParallelLinear):
    """A :class:`RowParallelLinear` with a LoRA adapter: ``A_r`` ``[r, in/tp]`` this rank's input columns,
    ``B`` ``[out, r]`` replicated; one all-reduce carries the base and the adapter's partial sums."""

    def __init__(self, base: RowParallelLinear, a: torch.Tensor, b: torch.Tensor, scaling: float, dropout: float,
                 tp: TPContext):
        nn.Module.__init__(self)
        self.tp = tp
        self.weight, self.bias = base.weight, base.bias
        self.lora_A = LoraMatrix(a)
        self.lora_B = LoraMatrix(b)
        tag_sharded(self.lora_A.weight, 1)
        self.scaling = scaling
        self.dropout = dropout

    def forward(self, x: torch.Tensor) -> torch.Tensor:  # [B, S, in/tp] -> [B, S, out]
        lx = x
        if self.dropout and self.training:  # the full input's mask, this rank's columns of it
            width = x.shape[-1]
            mask = _dropout_mask((*x.shape[:-1], width * self.tp.size), self.dropout, x)
            lx = x * mask[..., self.tp.rank * width:(self.tp.rank + 1) * width]
        if self.tp.size == 1:
            y, h = F.linear(x, self.weight), F.linear(lx, self.lora_A.weight)
        else:
            sizes = [self.weight.shape[0], self.lora_A.weight.shape[0]]  # out, r
            both = torch.cat([F.linear(x, self.weight), F.linear(lx, self.lora_A.weight)], dim=-1)  # [B, S, out + r]
            y, h = reduce_from_tp(both, self.tp).split(sizes, dim=-1)
        if self.bias is not None:
            y = y + self.bias
        return y + F.linear(h, self.lora_B.weight) * self.scaling


class LoraReplicatedLinear(nn.Module):
    """An ``nn.Linear`` outside the tensor-parallel region with a LoRA adapter, ``A`` and ``B`` whole: peft's
    own LoRA (the input, the output and every gradient are the same on each TP rank, so no collective)."""

    def __init__(self, base: nn.Linear, a: torch.Tensor, b: torch.Tensor, scaling: float, dropout: float):
        super().__init__()
        self.weight, self.bias = base.weight, base.bias
        self.lora_A = LoraMatrix(a)
        self.lora_B = LoraMatrix(b)
        self.scaling = scaling
        self.dropout = dropout

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        y = F.linear(x, self.weight, self.bias)
        if self.dropout and self.training:
            x = x * _dropout_mask(x.shape, self.dropout, x)
        return y + F.linear(F.linear(x, self.lora_A.weight), self.lora_B.weight) * self.scaling


def lora_parameters(module: nn.Module) -> list[nn.Parameter]:
    """Every LoRA matrix in ``module``."""
    return [m.weight for m in module.modules() if isinstance(m, LoraMatrix)]


def freeze_base(module: nn.Module) -> None:
    """Let only the LoRA matrices of ``module`` train: every other parameter gets ``requires_grad=False``
    (no gradient, so DeepSpeed gives it no gradient buffer and no optimizer state)."""
    keep = {id(p) for p in lora_parameters(module)}
    for p in module.parameters():
        p.requires_grad_(id(p) in keep)


@contextmanager
def adapters_off(module: nn.Module) -> Iterator[None]:
    """Within it, every LoRA adapter of ``module`` adds nothing (its scale is 0: ``y = W x + 0``, exactly the
    base model's output): peft's ``disable_adapter()``, the reference model of a LoRA preference run."""
    adapted = [m for m in module.modules() if hasattr(m, "lora_A") and hasattr(m, "scaling")]
    scales = [m.scaling for m in adapted]
    for m in adapted:
        m.scaling = 0.0
    try:
        yield
    finally:
        for m, scale in zip(adapted, scales):
            m.scaling = scale
