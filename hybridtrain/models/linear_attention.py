"""Packed documents through a linear-attention block (Gated DeltaNet: Qwen3.5, Qwen3-Next).

A Gated DeltaNet block has no attention mask to keep a packed row's documents apart: its token mixer carries a
recurrent state ``[Hv, dk, dv]`` per head and a causal conv1d window of ``K - 1`` tokens along the whole row, so a
document would start from the state and the conv inputs the previous document left (transformers' CPU path,
``torch_chunk_gated_delta_rule`` and its PyTorch conv, ignores ``cu_seqlens``). A document start is a reset of both.

hybridtrain runs the block's linear-attention module once per document instead (:func:`run_per_document`): every
document is cut out of its row, the documents of one length are stacked into one batch ``[n, L, H]`` and run through
transformers' own module forward, and the outputs are put back where the documents were. That is what transformers
computes for each document alone (rows of a batch never mix), with transformers' module code unchanged. The rest of
the block (norms, MLP, an MoE layer with its expert-parallel all-to-all) runs once on the whole micro-batch, so the
number of collectives outside the mixer does not depend on the documents (ranks of one expert-parallel group hold
different micro-batches). :func:`split_documents` installs this on a module: its forward takes the documents as the
keyword ``documents`` (the decoder block passes its keywords on to the mixer). Document starts are where the position
ids do not go up by one, transformers' own rule (``find_packed_sequence_indices``).

A GPU path through flash-linear-attention's variable-length kernels (``chunk_gated_delta_rule(...,
cu_seqlens=...)``, ``causal_conv1d`` with ``cu_seqlens``) is tested against this one in ``tests/gpu``.
"""
from __future__ import annotations

import functools
from dataclasses import dataclass
from typing import Callable

import torch
import torch.nn as nn


@dataclass(frozen=True)
class Documents:
    """The documents of packed rows ``[B, S]``, grouped by length: for each length ``L``, the row and first column of
    every document of that length (``rows [n]``, ``starts [n]``, int64, on the rows' device)."""

    groups: tuple[tuple[int, torch.Tensor, torch.Tensor], ...]
    """``(L, rows [n], starts [n])`` per distinct document length."""

    @classmethod
    def of(cls, pos: torch.Tensor) -> "Documents | None":
        """The documents of rows with position ids ``pos [B, S]`` (a start wherever the ids do not go up by one, and
        at every row's first token); ``None`` when every row is one document (one host read of ``pos``)."""
        starts = torch.ones_like(pos, dtype=torch.bool)  # [B, S]
        starts[:, 1:] = pos[:, 1:] != pos[:, :-1] + 1
        if not bool(starts[:, 1:].any()):
            return None
        spans: dict[int, list[tuple[int, int]]] = {}
        length = pos.shape[1]
        for row, marks in enumerate(starts.cpu().tolist()):
            cuts = [i for i, m in enumerate(marks) if m] + [length]
            for lo, hi in zip(cuts, cuts[1:]):
                spans.setdefault(hi - lo, []).append((row, lo))
        groups = tuple((n, torch.tensor([r for r, _ in s], device=pos.device),
                        torch.tensor([c for _, c in s], device=pos.device)) for n, s in sorted(spans.items()))
        return cls(groups)


def run_per_document(fn: Callable[..., torch.Tensor], hidden: torch.Tensor, docs: Documents,
                     per_token: tuple[torch.Tensor, ...] = ()) -> torch.Tensor:
    """``fn(x [n, L, H], *per_token cut alike)`` run on the documents of each length of ``hidden [B, S, H]``, its
    outputs ``[n, L, H]`` put back in place: ``[B, S, H]``. ``per_token``: tensors ``[B, S, ...]`` cut out with the
    documents (the rotary table the block takes)."""
    out = hidden.new_zeros(hidden.shape)
    for length, rows, starts in docs.groups:
        cols = starts[:, None] + torch.arange(length, device=hidden.device)  # [n, L]
        idx = (rows[:, None].expand_as(cols), cols)
        y = fn(hidden[idx], *(t[idx] for t in per_token))  # [n, L, H]
        out = out.index_put(idx, y)  # out of place: autograd carries each document's gradient back
    return out


def _per_document_forward(module: nn.Module, hidden_states: torch.Tensor, *args, documents: Documents | None = None,
                          **kwargs) -> torch.Tensor:
    """``module``'s own class forward, once per document of ``documents`` (``None``: once on the whole rows)."""
    forward = type(module).forward  # transformers' forward, not this instance's override (no hooks run again)
    if documents is None:
        return forward(module, hidden_states, *args, **kwargs)
    return run_per_document(lambda x: forward(module, x, *args, **kwargs), hidden_states, documents)


def split_documents(module: nn.Module) -> None:
    """Make ``module`` (a Gated DeltaNet, ``[B, S, H] -> [B, S, H]``) run per document when its forward is given
    ``documents=`` (:class:`Documents`); its hooks (the tensor-parallel "f") still run once, on the whole input."""
    module.forward = functools.partial(_per_document_forward, module)
