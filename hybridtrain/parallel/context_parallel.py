"""Context parallelism's attention, the all-gather-KV form (Llama 3, Megatron's ``all_gather`` mode, torchtitan).

Each row's ``S`` tokens are cut into ``2 x cp`` equal chunks and rank ``r`` of the cp group holds chunks ``r`` and
``2 x cp - 1 - r`` (head-tail: under a causal mask every rank then has the same work). In attention each rank keeps
the queries of its own tokens, all-gathers the keys and values of the whole row from its cp peers (the backward
sums their gradients back to the owner), and masks by *global* token index: the mask transformers would build for
the full row, restricted to this rank's query rows. Everything outside attention is token-wise and runs on the
local tokens unchanged; the rotary embedding only needs the local tokens' position ids.

The HF attention modules stay as they are: :func:`register_attention` adds :func:`context_parallel_attention` to
transformers' ``AttentionInterface``, a model selects it with ``config._attn_implementation``, and the cp group comes
per call through the ``cp_context`` keyword (a :class:`CPAttention`).

Plain causal rows under sdpa (one document per row, no sliding window, no attention dropout) need no mask: each of
the rank's two chunks attends to the keys up to its end, bottom-right causal (:mod:`hybridtrain.parallel.causal_chunks`).
Packed documents and sliding windows under sdpa or eager get the dense mask (``[B, 1, S / cp, S]``, made once per
micro-batch), as transformers' own sdpa and eager masks are; FlashAttention 2 takes the documents as variable-length
sequences (:func:`flash_segments`) and keeps no mask.
"""
from __future__ import annotations

import sys
from dataclasses import dataclass, field
from typing import Any, Optional

import torch

from hybridtrain.parallel.collectives import all_gather_autograd
from hybridtrain.parallel.context import CPContext, chunk_indices

__all__ = ["ATTENTION_NAME", "BASES", "CPAttention", "chunk_indices", "context_parallel_attention", "cp_attention_mask",
           "gather_sequence", "register_attention"]

ATTENTION_NAME = "hybridtrain_cp"
"""The name :func:`register_attention` gives :func:`context_parallel_attention` in transformers' registry."""


def gather_sequence(x: torch.Tensor, cp: CPContext, dim: int) -> torch.Tensor:
    """The whole row from every cp rank's local piece: ``x`` is ``[..., S / cp, ...]`` along ``dim`` (this rank's two
    chunks, :func:`chunk_indices`); the result is ``[..., S, ...]`` in global token order. Differentiable: the gradient
    of every gathered token goes back, summed over the ranks that used it, to the rank that holds it
    (:func:`~hybridtrain.parallel.collectives.all_gather_autograd`). ``cp.size == 1``: ``x`` itself."""
    if cp.size == 1:
        return x
    pieces = all_gather_autograd(x, cp.group)  # cp x [..., S/cp, ...], group-rank order
    halves = [p.chunk(2, dim=dim) for p in pieces]  # rank r: (chunk r, chunk 2cp-1-r), each [..., S/(2cp), ...]
    # Chunks 0..cp-1 are the ranks' first halves in rank order, chunks cp..2cp-1 their second halves in reverse.
    ordered = [h[0] for h in halves] + [h[1] for h in reversed(halves)]
    return torch.cat(ordered, dim=dim)  # [..., S, ...]


def cp_attention_mask(positions: torch.Tensor, q_index: torch.Tensor, sliding_window: Optional[int],
                      dtype: torch.dtype, additive: bool) -> torch.Tensor:
    """The mask transformers builds for the full row, restricted to this rank's query rows: ``[B, 1, Sq, S]``.

    ``positions``: the full rows' position ids ``[B, S]`` (restarting at 0 at each packed document);
    ``q_index``: the global indices ``[Sq]`` of this rank's queries; ``sliding_window``: the layer's window (``None``:
    full causal). Boolean (True = attend, for sdpa), or additive ``0`` / ``finfo(dtype).min`` (for eager).

    Composed from ``transformers.masking_utils`` as ``create_causal_mask`` / ``create_sliding_window_causal_mask``
    compose it in 5.24 (causal or sliding-window causal; when any row is packed, indices remapped to position ids
    and intersected with the packed-sequence mask of ``find_packed_sequence_indices``), then evaluated by
    broadcasting index tensors as ``sdpa_mask``'s non-vmap path does, with the query indices ``q_index`` instead of
    ``arange(S)``: only the rows this rank needs are ever built."""
    from transformers import masking_utils as mu

    batch, seq = positions.shape
    device = positions.device
    if sliding_window is None:
        mask_function = mu.causal_mask_function
    else:
        mask_function = mu.sliding_window_causal_mask_function(sliding_window)
    packed = mu.find_packed_sequence_indices(positions)  # [B, S] document ids, None when no row is packed
    if packed is not None:
        mask_function = mu.remap_positions_for_packed_sequence(mask_function, positions)
        mask_function = mu.and_masks(mask_function, mu.packed_sequence_mask_function(packed))
    b = torch.arange(batch, device=device)[:, None, None, None]  # [B, 1, 1, 1]
    h = torch.arange(1, device=device)[None, :, None, None]  # [1, 1, 1, 1]
    q = q_index.to(device)[None, None, :, None]  # [1, 1, Sq, 1]
    kv = torch.arange(seq, device=device)[None, None, None, :]  # [1, 1, 1, S]
    mask = mask_function(b, h, q, kv).expand(batch, 1, q_index.numel(), seq)  # [B, 1, Sq, S] bool
    if additive:  # as transformers' eager_mask turns the boolean mask into a bias
        return torch.where(mask, torch.zeros((), device=device, dtype=dtype), torch.finfo(dtype).min)
    return mask


@dataclass
class CPAttention:
    """What :func:`context_parallel_attention` needs per call, passed as the ``cp_context`` keyword of the model's
    forward (transformers hands unknown keywords down to the attention function)."""

    cp: CPContext
    """This rank's context-parallel group."""
    base: str = "sdpa"
    """The attention that runs on the gathered keys and values (:data:`BASES`): ``"sdpa"`` (transformers' function)
    or ``"eager"`` (the module's own family function, soft-capping and all)."""
    position_ids: Optional[torch.Tensor] = None
    """The full rows' position ids ``[B, S]`` (what packing writes: 0 at each document's start); ``None``: one
    document per row (``arange(S)``)."""
    segments: Optional["FlashSegments"] = None
    """FlashAttention 2's pieces (:func:`flash_segments`) of these rows for this rank, made once per micro-batch and
    shared by the blocks (``None``: made at the call)."""
    masks: dict = field(default_factory=dict, repr=False)
    """The masks made so far for these rows, by ``(window, dtype, additive)``: one per micro-batch and kind of
    layer, shared by every block (autograd then keeps one tensor for the backward, not one per block)."""


BASES = ("sdpa", "eager", "flash_attention_2")
"""The attentions :func:`context_parallel_attention` can run on the gathered keys and values: sdpa (mask-free on
plain causal rows, :mod:`~hybridtrain.parallel.causal_chunks`) and eager with the dense ``[B, 1, Sq, S]`` mask;
FlashAttention 2 through its variable-length kernel, one sequence per piece of a document in a rank's chunks
(:func:`flash_segments`), which keeps no mask."""


def _base_function(module: torch.nn.Module, base: str):
    if base not in BASES:
        raise ValueError(f"cp attention base {base!r}: use one of {BASES}")
    if base == "flash_attention_2":
        from transformers.integrations.flash_attention import flash_attention_forward

        return flash_attention_forward
    if base == "eager":
        # Families differ in eager attention (Gemma 2's soft-capping, ...): take the one of the module's own
        # modeling file, the function its forward falls back to.
        family = sys.modules[type(module).__module__]
        if not hasattr(family, "eager_attention_forward"):
            raise ValueError(f"{type(module).__module__} defines no eager_attention_forward; use base='sdpa'")
        return family.eager_attention_forward
    from transformers.modeling_utils import ALL_ATTENTION_FUNCTIONS

    return ALL_ATTENTION_FUNCTIONS["sdpa"]


def context_parallel_attention(module: torch.nn.Module, query: torch.Tensor, key: torch.Tensor, value: torch.Tensor,
                               attention_mask: Optional[torch.Tensor], **kwargs: Any) -> tuple[torch.Tensor, Any]:
    """transformers' attention-function signature over this rank's tokens: ``query`` ``[B, H, S/cp, D]``, ``key`` and
    ``value`` ``[B, Hkv, S/cp, D]`` (grouped-query heads are repeated inside the base function). Gathers the row's keys
    and values over the cp group and runs the base attention: mask-free for sdpa on plain causal rows
    (:func:`~hybridtrain.parallel.causal_chunks.runs_attention`), else with the global-index mask
    (:func:`cp_attention_mask`) (``kwargs["cp_context"]``, a :class:`CPAttention`); returns its ``(output [B, S/cp, H, D], weights)``.

    ``attention_mask`` must be ``None``: transformers' mask builders return ``None`` for an implementation they do not
    know, and a padding mask has no meaning here (rows are packed; documents are told apart by position ids).
    Training only (``use_cache=False``, as ``plan/hf.py`` sets it): with a KV cache the module would store this rank's
    keys alone."""
    ctx: Optional[CPAttention] = kwargs.pop("cp_context", None)
    if not isinstance(ctx, CPAttention):
        raise ValueError(f"{ATTENTION_NAME} attention needs the keyword cp_context=CPAttention(...) in the model's "
                         f"forward, got {type(ctx).__name__}")
    if attention_mask is not None:
        raise ValueError(f"{ATTENTION_NAME} attention builds its own mask from cp_context.position_ids; got an "
                         f"attention_mask of shape {tuple(attention_mask.shape)} (pass attention_mask=None)")
    if not getattr(module, "is_causal", True):
        raise NotImplementedError(f"{ATTENTION_NAME} attention is causal only; {type(module).__name__} is not")
    base = _base_function(module, ctx.base)  # before the collective: a bad name fails on every rank alike
    cp = ctx.cp
    batch, local = query.shape[0], query.shape[2]
    seq = local * cp.size
    positions = ctx.position_ids
    if positions is None:
        positions = torch.arange(seq, device=query.device).expand(batch, seq)  # [B, S]
    elif positions.shape[-1] != seq:
        raise ValueError(f"cp_context.position_ids cover {positions.shape[-1]} tokens; the row has cp x S/cp = {seq}")
    positions = positions.to(query.device).expand(batch, seq)
    key = gather_sequence(key, cp, dim=2)  # [B, Hkv, S, D]
    value = gather_sequence(value, cp, dim=2)  # [B, Hkv, S, D]
    if ctx.base == "flash_attention_2":
        return flash_varlen_attention(base, module, query, key, value, positions, cp.indices(seq), ctx.segments,
                                      **kwargs)
    # The layer's window as the families hand it to flash attention (Mistral from the config, Qwen 2 and Gemma 2
    # per layer, None on full layers); the module attribute for a family that does not pass it.
    window = kwargs.get("sliding_window", getattr(module, "sliding_window", None))
    if ctx.base == "sdpa" and ctx.position_ids is None and window is None and _mask_free(kwargs):
        from hybridtrain.parallel.causal_chunks import runs_attention

        out = runs_attention(query, key, value, cp.ranges(seq), kwargs.get("scaling"))  # [B, H, S/cp, D]
        return out.transpose(1, 2).contiguous(), None  # as transformers' sdpa_attention_forward returns it
    # Additive for sdpa too: torch's sdpa turns a boolean mask into a new float one at every call, which each
    # block's backward would then keep; one float mask made here is kept once for all of them.
    additive = True
    mask = ctx.masks.get((window, query.dtype, additive))
    if mask is None:  # the first block of this micro-batch with this window: [B (or 1), 1, S/cp, S]
        mask = ctx.masks[window, query.dtype, additive] = cp_attention_mask(
            positions, cp.indices(seq, query.device), window, query.dtype, additive=additive)
    return base(module, query, key, value, mask, **kwargs)


MASKED_ONLY = ("softcap", "position_bias", "s_aux", "sinks")
"""Keywords of the attention call that only the base attention with a mask handles (sdpa raises on a soft-cap itself)."""


def _mask_free(kwargs: dict) -> bool:
    """Whether sdpa's call can run mask-free over the rank's chunks (:mod:`~hybridtrain.parallel.causal_chunks`):
    no attention dropout (the kernels merged there run without it) and none of :data:`MASKED_ONLY`."""
    return not kwargs.get("dropout") and all(kwargs.get(k) is None for k in MASKED_ONLY)


def register_attention() -> str:
    """Add :func:`context_parallel_attention` to transformers' ``AttentionInterface`` as ``"hybridtrain_cp"`` (once;
    calling again changes nothing) and return that name, the value for ``config._attn_implementation``.

    A registry entry because it is transformers' extension point: every attention module looks its function up by
    ``config._attn_implementation`` at call time, so the HF modules run unchanged. The entry holds no state; the
    group and the row's position ids come with each call (``cp_context``)."""
    from transformers import AttentionInterface
    from transformers.modeling_utils import ALL_ATTENTION_FUNCTIONS

    if ALL_ATTENTION_FUNCTIONS.get(ATTENTION_NAME) is not context_parallel_attention:
        AttentionInterface.register(ATTENTION_NAME, context_parallel_attention)
    return ATTENTION_NAME


@dataclass(frozen=True)
class FlashSegments:
    """FlashAttention's variable-length arguments for one rank's queries against the gathered rows: one sequence
    per piece of a document inside one of the rank's chunks, its queries that piece, its keys the document's
    tokens from its start to the piece's end."""

    key_index: torch.Tensor
    """``[Tk]`` int64 indices into the gathered keys flattened over the batch (``b x S + token``), piece by piece."""
    cu_q: torch.Tensor
    """``[n + 1]`` int32 offsets of the pieces' queries in the rank's queries flattened over the batch."""
    cu_k: torch.Tensor
    """``[n + 1]`` int32 offsets of the pieces' keys in :attr:`key_index`."""
    max_q: int
    max_k: int


def flash_segments(positions: torch.Tensor, q_index: torch.Tensor) -> FlashSegments:
    """The :class:`FlashSegments` of rows with position ids ``positions [B, S]`` (0 where each packed document
    starts) for the rank holding tokens ``q_index`` (its two chunks, in order) of every row.

    FlashAttention's causal mask for a sequence of ``Sq`` queries and ``Sk >= Sq`` keys is aligned at the bottom
    right (flash-attn >= 2.1): query ``i`` sees keys ``j <= i + Sk - Sq``. A piece's queries are the global tokens
    ``[qs, qe)`` of one document starting at ``ds``; its keys ``[ds, qe)``; so query ``qs + i`` sees keys up to
    itself, within its document: the mask of :func:`cp_attention_mask`, with no mask tensor. A sliding window
    ``(w - 1, w - 1)`` (transformers' ``window_size``) is aligned the same way. Computed on the host (the offsets
    must be host integers for the kernel's launch): one copy of the position ids per stage and micro-batch, then
    tensor operations only (no loop over tokens or pieces)."""
    pos = positions.detach().cpu()
    q = q_index.detach().cpu().long()
    batch, seq = pos.shape
    local = q.numel()
    restart = torch.ones_like(pos, dtype=torch.bool)
    restart[:, 1:] = pos[:, 1:] != pos[:, :-1] + 1  # a document starts where the position ids do not count on
    ar = torch.arange(seq).expand(batch, seq)
    starts = torch.where(restart, ar, torch.zeros_like(ar)).cummax(dim=1).values  # [B, S] start of each token's document
    doc = starts[:, q]  # [B, Sq] the document start of each of the rank's tokens
    # A piece starts at a row's first query, at a chunk edge (the indices jump) and at a document's start.
    new = torch.ones(batch, local, dtype=torch.bool)
    new[:, 1:] = (q[1:] != q[:-1] + 1) | (doc[:, 1:] != doc[:, :-1])
    first = new.reshape(-1).nonzero().squeeze(1)  # each piece's first query, flattened over the batch
    last = torch.cat([first[1:], torch.tensor([batch * local])]) - 1
    flat_q = q.repeat(batch)
    row = first // local
    qs, qe, ds = flat_q[first], flat_q[last] + 1, doc.reshape(-1)[first]  # queries [qs, qe), keys [ds, qe)
    len_q, len_k = qe - qs, qe - ds
    zero = torch.zeros(1, dtype=torch.long)
    cu_q, cu_k = torch.cat([zero, len_q.cumsum(0)]), torch.cat([zero, len_k.cumsum(0)])
    piece = torch.repeat_interleave(torch.arange(first.numel()), len_k)  # the piece of each key slot
    keys = (row * seq + ds)[piece] + torch.arange(int(cu_k[-1])) - cu_k[:-1][piece]
    device = positions.device
    return FlashSegments(keys.to(device), cu_q.to(torch.int32).to(device), cu_k.to(torch.int32).to(device),
                         int(len_q.max()), int(len_k.max()))


class _ConfigAs:
    """A model config read through, its ``_attn_implementation`` replaced (:class:`AttentionAs`)."""

    def __init__(self, config: Any, name: str) -> None:
        self._config, self._attn_implementation = config, name

    def __getattr__(self, key: str) -> Any:
        return getattr(self._config, key)


class AttentionAs:
    """An attention module seen with ``config._attn_implementation = name``, every other attribute its own.

    transformers' ``flash_attention_forward`` picks its kernel by ``module.config._attn_implementation``; at cp > 1
    the config says :data:`ATTENTION_NAME` (so that every module calls :func:`context_parallel_attention`), a name
    it knows no kernel for ("Could not find the currently requested flash attention implementation"). The base
    attention gets the module under the name it stands for; the shared config is never written mid-forward."""

    def __init__(self, module: torch.nn.Module, name: str) -> None:
        self._module, self.config = module, _ConfigAs(module.config, name)

    def __getattr__(self, key: str) -> Any:
        return getattr(self._module, key)


def flash_varlen_attention(flash, module: torch.nn.Module, query: torch.Tensor, key: torch.Tensor, value: torch.Tensor,
                           positions: torch.Tensor, q_index: torch.Tensor, segments: Optional[FlashSegments] = None,
                           **kwargs: Any) -> tuple[torch.Tensor, Any]:
    """``flash`` (transformers' ``flash_attention_forward``, or a stand-in with its signature) over this rank's
    queries ``[B, H, Sq, D]`` and the gathered ``key``/``value`` ``[B, Hkv, S, D]``, one variable-length sequence
    per :func:`flash_segments` piece (``segments``, else made here); returns ``([B, Sq, H, D], None)`` as the
    attention functions do."""
    batch, heads, local, dim = query.shape
    seg = segments if segments is not None else flash_segments(positions, q_index)
    q = query.permute(1, 0, 2, 3).reshape(heads, batch * local, dim).unsqueeze(0)  # [1, H, B x Sq, D]: pieces in order

    def pick(x: torch.Tensor) -> torch.Tensor:  # [B, Hkv, S, D] -> [1, Hkv, Tk, D], each piece's keys
        flat = x.permute(1, 0, 2, 3).reshape(x.shape[1], -1, x.shape[-1])  # [Hkv, B x S, D]
        return flat.index_select(1, seg.key_index).unsqueeze(0)

    kwargs.pop("position_ids", None)  # the pieces' offsets say it all; position ids would make another varlen
    module = AttentionAs(module, "flash_attention_2") if module is not None else None
    out, weights = flash(module, q, pick(key), pick(value), None, cu_seq_lens_q=seg.cu_q, cu_seq_lens_k=seg.cu_k,
                         max_length_q=seg.max_q, max_length_k=seg.max_k, is_causal=True, **kwargs)
    return out.reshape(batch, local, heads, -1), weights  # [1, B x Sq, H, D] -> [B, Sq, H, D]
