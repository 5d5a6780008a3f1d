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

**Context parallelism** (``parallel.cp`` > 1): a rank holds two chunks of every row (:class:`RankChunks`), and the
mixer runs each from the carry the chunk before it in sequence order ended with, passed between the cp ranks by
:func:`~hybridtrain.parallel.state_pass.pass_state`. The carry is what transformers' own module keeps in a cache
between two calls: the last ``K - 1`` conv inputs per channel and the recurrent state ``[Hv, dk, dv]``. So a chunk
runs through transformers' forward unchanged, given a cache (:class:`_Carry`) that holds the incoming carry and
keeps the outgoing one. Inside a chunk the documents run as above; the first piece of a chunk continues the
document of the chunk before it (starts from the carry) unless a document starts exactly there, and the last
piece's carry is the chunk's.
"""
from __future__ import annotations

import functools
from dataclasses import dataclass
from typing import Callable

import torch
import torch.nn as nn

from hybridtrain.parallel.context import CPContext
from hybridtrain.parallel.state_pass import CarryLog, pass_state


def _starts(pos: torch.Tensor) -> torch.Tensor:
    """``[B, S]`` bool: where a document starts in rows with position ids ``pos`` (every row's first token, and
    wherever the ids do not go up by one: transformers' ``find_packed_sequence_indices`` rule)."""
    starts = torch.ones_like(pos, dtype=torch.bool)
    starts[:, 1:] = pos[:, 1:] != pos[:, :-1] + 1
    return starts


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
        starts = _starts(pos)  # [B, S]
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


def _per_document_forward(module: nn.Module, hidden_states: torch.Tensor, *args,
                          documents: "Documents | RankChunks | None" = None, carry_log: CarryLog | None = None,
                          **kwargs) -> torch.Tensor:
    """``module``'s own class forward, once per document of ``documents`` (``None``: once on the whole rows); for
    :class:`RankChunks`, over a context-parallel rank's chunks with the carry passed between the ranks
    (``carry_log``: the block's :class:`~hybridtrain.parallel.state_pass.CarryLog` under activation checkpointing)."""
    forward = type(module).forward  # transformers' forward, not this instance's override (no hooks run again)
    if isinstance(documents, RankChunks):
        return _chained_forward(module, hidden_states, documents, carry_log, kwargs)
    if documents is None:
        return forward(module, hidden_states, *args, **kwargs)
    return run_per_document(lambda x: forward(module, x, *args, **kwargs), hidden_states, documents)


def split_documents(module: nn.Module) -> None:
    """Make ``module`` (a Gated DeltaNet, ``[B, S, H] -> [B, S, H]``) run per document when its forward is given
    ``documents=`` (:class:`Documents`), or over a cp rank's chunks (:class:`RankChunks`, ``[B, S / cp, H]``); its
    hooks (the tensor-parallel "f") still run once, on the whole input."""
    module.forward = functools.partial(_per_document_forward, module)


@dataclass(frozen=True)
class ChunkPieces:
    """The pieces of documents inside one chunk of ``length`` tokens of every row, grouped by length as
    :class:`Documents` groups documents (``starts`` relative to the chunk's first token)."""

    length: int
    groups: tuple[tuple[int, torch.Tensor, torch.Tensor], ...]
    """``(L, rows [n], starts [n])`` per distinct piece length."""
    continues: torch.Tensor
    """``[B]`` bool: the chunk's first token continues the document of the chunk before it (no start there)."""


@dataclass(frozen=True)
class RankChunks:
    """A context-parallel rank's two chunks of every row (:meth:`CPContext.ranges`) and their document pieces."""

    cp: CPContext
    chunks: tuple[ChunkPieces, ChunkPieces]

    @classmethod
    def of(cls, pos: torch.Tensor, cp: CPContext, packed: bool = True) -> "RankChunks":
        """The chunks of rows with the whole rows' position ids ``pos [B, S]`` held by cp rank ``cp.rank``;
        ``packed=False``: one document per row (no host read of ``pos``)."""
        batch, seq = pos.shape
        if packed:
            marks = _starts(pos).cpu()  # [B, S]
        else:
            marks = torch.zeros(batch, seq, dtype=torch.bool)
            marks[:, 0] = True
        chunks = []
        for lo, hi in cp.ranges(seq):
            spans: dict[int, list[tuple[int, int]]] = {}
            for row, m in enumerate(marks[:, lo:hi].tolist()):
                cuts = [0] + [i for i, x in enumerate(m) if x and i > 0] + [hi - lo]
                for a, b in zip(cuts, cuts[1:]):
                    spans.setdefault(b - a, []).append((row, a))
            groups = tuple((n, torch.tensor([r for r, _ in s], device=pos.device),
                            torch.tensor([c for _, c in s], device=pos.device)) for n, s in sorted(spans.items()))
            chunks.append(ChunkPieces(hi - lo, groups, (~marks[:, lo]).to(pos.device)))
        return cls(cp, (chunks[0], chunks[1]))


class _Carry:
    """What transformers' Gated DeltaNet forward asks of its ``cache`` argument, for one call over pieces ``[n, L]``:
    the incoming conv window ``[n, C, K - 1]`` and recurrent state ``[n, Hv, dk, dv]`` (zeros for a piece that
    starts a document), and the outgoing ones it leaves. Not a transformers ``Cache``: it keeps no layers and
    never updates in place, so autograd follows the carry through."""

    def __init__(self, conv: torch.Tensor, state: torch.Tensor) -> None:
        self.conv, self.state = conv, state
        self.conv_out: torch.Tensor | None = None
        self.state_out: torch.Tensor | None = None

    def get_recurrent_state(self, layer_idx: int, state_idx: int = 0) -> torch.Tensor:
        return self.state

    def get_conv_state(self, layer_idx: int, state_idx: int = 0) -> torch.Tensor:
        return self.conv

    def is_recording_past(self, layer_idx: int) -> bool:
        return True  # keeps a one-token piece off the in-place decode step (causal_conv1d_update)

    def get_recurrent_states_to_keep(self, layer_idx: int | None = None) -> int:
        return 0

    def update_conv_state(self, conv_states: torch.Tensor, layer_idx: int, state_idx: int = 0, **kwargs):
        full = torch.cat([self.conv.to(conv_states.dtype), conv_states], dim=-1)  # [n, C, K - 1 + L]
        self.conv_out = full[..., -self.conv.shape[-1]:]  # the last K - 1 inputs (zeros before a document)
        return full

    def update_recurrent_state(self, recurrent_states: torch.Tensor, layer_idx: int, state_idx: int = 0, **kwargs):
        self.state_out = recurrent_states
        return recurrent_states


def _carry_sizes(module: nn.Module) -> tuple[tuple[int, int], tuple[int, int, int]]:
    """``((C, K - 1), (Hv, dk, dv))``: this rank's conv window and recurrent state per row (after tensor
    parallelism divided the heads)."""
    return ((int(module.conv_dim), int(module.conv_kernel_size) - 1),
            (int(module.num_v_heads), int(module.head_k_dim), int(module.head_v_dim)))


def _chunk_run(module: nn.Module, chunks: RankChunks, kwargs: dict):
    """The :data:`~hybridtrain.parallel.state_pass.ChunkRun` of ``module`` over ``chunks``: transformers' forward
    per group of pieces, each from a :class:`_Carry`; the carry ``[B, D]`` is the conv window and the state,
    flattened (in :func:`~hybridtrain.parallel.state_pass.carry_dtype`)."""
    forward = type(module).forward
    (c, k1), (hv, dk, dv) = _carry_sizes(module)
    kwargs = {key: v for key, v in kwargs.items() if key not in ("cache", "attention_mask")}

    def run(index: int, x: torch.Tensor, carry: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        pieces = chunks.chunks[index]
        batch = x.shape[0]
        conv_in = carry[:, :c * k1].reshape(batch, c, k1)  # [B, C, K - 1]
        state_in = carry[:, c * k1:].reshape(batch, hv, dk, dv)  # [B, Hv, dk, dv]
        y = x.new_zeros(x.shape)  # [B, c, H]
        conv_out, state_out = torch.zeros_like(conv_in), torch.zeros_like(state_in)
        for length, rows, starts in pieces.groups:
            cols = starts[:, None] + torch.arange(length, device=x.device)  # [n, L]
            idx = (rows[:, None].expand_as(cols), cols)
            takes = (starts == 0) & pieces.continues[rows]  # [n]: continues the document of the chunk before
            cache = _Carry(torch.where(takes[:, None, None], conv_in[rows], 0.0).to(x.dtype),
                           torch.where(takes[:, None, None, None], state_in[rows], 0.0))
            y = y.index_put(idx, forward(module, x[idx], cache=cache, attention_mask=None, **kwargs))
            last = (starts + length == pieces.length).nonzero().squeeze(1)  # the pieces that end the chunk
            conv_out = conv_out.index_put((rows[last],), cache.conv_out[last].to(conv_out.dtype))
            state_out = state_out.index_put((rows[last],), cache.state_out[last].to(state_out.dtype))
        return y, torch.cat([conv_out.flatten(1), state_out.flatten(1)], dim=1)  # [B, c, H], [B, D]

    return run, c * k1 + hv * dk * dv


def _chained_forward(module: nn.Module, hidden: torch.Tensor, chunks: RankChunks, log: CarryLog | None,
                     kwargs: dict) -> torch.Tensor:
    """The mixer over this cp rank's two chunks ``hidden [B, 2c, H]``, the carry passed along the cp ranks."""
    run, width = _chunk_run(module, chunks, kwargs)
    return pass_state(module, run, hidden, chunks.cp, width, log)
