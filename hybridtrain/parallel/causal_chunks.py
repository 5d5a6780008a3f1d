"""Causal attention of a context-parallel rank's query chunks against the gathered row, with no mask tensor.

Under plain causal attention (one document per row, no sliding window) a cp rank's queries are two contiguous runs
of global tokens, ``[qs, qe)`` each (:meth:`~hybridtrain.parallel.context.CPContext.ranges`), and query ``qs + i``
sees keys ``[0, qs + i]``: a causal mask aligned at the *bottom right* of the ``[qe - qs, qe]`` block of scores. No
kernel call with ``is_causal=True`` means that (sdpa aligns it at the top left), so a mask by global index
(:func:`~hybridtrain.parallel.context_parallel.cp_attention_mask`) would be needed; it is ``[s/cp, s]`` and at long
context weighs like a block's activations. This module computes the same numbers without it:

* on CUDA, torch's own lower-right causal bias (``torch.nn.attention.bias.causal_lower_right``), which dispatches to
  FlashAttention (its ``is_causal`` is bottom-right) or to memory-efficient attention's lower-right mask type, and
  keeps no mask;
* on CPU, where torch's lower-right bias would materialize the mask, :class:`PrefixCausal`: the prefix keys
  ``[0, qs)`` are all visible and the diagonal block ``[qs, qe)`` is square causal, so torch's CPU flash kernel runs
  on each unmasked, and the two are merged by their log-sum-exps (the merge of ring attention; the backward gives
  each block the merged output and log-sum-exp, which is what the flash backward needs to produce the gradients of
  the whole softmax). Written here because torch exposes no CPU kernel for a bottom-right causal block, and the
  per-block kernel with its log-sum-exp is the one torch's own sdpa runs on CPU.

Grouped-query attention runs natively (keys and values are not repeated) where the kernel takes it: torch's CPU
flash kernel does; on CUDA, FlashAttention does, and otherwise the keys and values are repeated once over the row.
"""
from __future__ import annotations

import torch

__all__ = ["PrefixCausal", "lower_right_causal", "runs_attention"]


class PrefixCausal(torch.autograd.Function):
    """``query [B, H, Lq, D]`` against ``key``/``value [B, Hkv, P + Lq, D]`` where the first ``P`` keys are all
    visible and the last ``Lq`` are causal to the queries (query ``i`` sees prefix and diagonal keys ``<= i``).
    torch's CPU flash kernel (``aten._scaled_dot_product_flash_attention_for_cpu``) runs on each block; the outputs
    are merged by log-sum-exp, and the backward runs the kernel's backward on each block with the merged output
    and log-sum-exp. ``Hkv`` divides ``H`` (the kernel handles grouped-query attention)."""

    @staticmethod
    def forward(ctx, query, key, value, prefix: int, scale: float):
        flash = torch.ops.aten._scaled_dot_product_flash_attention_for_cpu
        o1, l1 = flash(query, key[:, :, :prefix], value[:, :, :prefix], 0.0, False, scale=scale)
        o2, l2 = flash(query, key[:, :, prefix:], value[:, :, prefix:], 0.0, True, scale=scale)
        lse = torch.logaddexp(l1, l2)  # [B, H, Lq], fp32 for low-precision inputs (as the kernel's own)
        w1, w2 = (l1 - lse).exp().unsqueeze(-1), (l2 - lse).exp().unsqueeze(-1)
        out = (o1.to(lse.dtype) * w1 + o2.to(lse.dtype) * w2).to(query.dtype)
        # The kernel's backward reads the output and log-sum-exp with its own layout ([B, L, H, D] / [B, L, H]
        # in memory): hand them over as it made them.
        out = torch.empty_like(o1).copy_(out)
        lse = torch.empty_like(l1).copy_(lse)
        ctx.save_for_backward(query, key, value, out, lse)
        ctx.prefix, ctx.scale = prefix, scale
        return out

    @staticmethod
    def backward(ctx, grad_out):
        query, key, value, out, lse = ctx.saved_tensors
        p, scale = ctx.prefix, ctx.scale
        back = torch.ops.aten._scaled_dot_product_flash_attention_for_cpu_backward
        grad_out = torch.empty_like(out).copy_(grad_out)
        dq1, dk1, dv1 = back(grad_out, query, key[:, :, :p], value[:, :, :p], out, lse, 0.0, False, scale=scale)
        dq2, dk2, dv2 = back(grad_out, query, key[:, :, p:], value[:, :, p:], out, lse, 0.0, True, scale=scale)
        return dq1 + dq2, torch.cat([dk1, dk2], dim=2), torch.cat([dv1, dv2], dim=2), None, None


def _cuda(query: torch.Tensor, key: torch.Tensor, value: torch.Tensor, scale: float) -> torch.Tensor:
    """torch's lower-right causal bias; keys and values repeated to every head unless FlashAttention takes the
    grouped heads as they are (the memory-efficient kernel does not)."""
    import torch.nn.functional as F
    from torch.nn.attention.bias import causal_lower_right

    bias = causal_lower_right(query.shape[2], key.shape[2])
    key, value, gqa = _heads_for_kernel(query, key, value, is_causal=False)
    return F.scaled_dot_product_attention(query, key, value, attn_mask=bias, scale=scale, enable_gqa=gqa)


def _heads_for_kernel(query: torch.Tensor, key: torch.Tensor, value: torch.Tensor, is_causal: bool):
    """``(key, value, enable_gqa)`` for sdpa: on CUDA, grouped KV heads repeated to every query head unless
    FlashAttention takes them as they are. Without that, fp32 (which flash refuses) with ``enable_gqa`` falls back
    to the math kernel, which keeps the whole ``[B, H, Lq, Lk]`` matrix: the memory-efficient kernel refuses GQA
    (GPU review 3, finding 9). On CPUs the grouped heads go as they are."""
    gqa = query.shape[1] != key.shape[1]
    if gqa and query.device.type == "cuda":
        from torch.backends.cuda import SDPAParams, can_use_flash_attention

        if not can_use_flash_attention(SDPAParams(query, key, value, None, 0.0, is_causal, True)):
            n = query.shape[1] // key.shape[1]
            return key.repeat_interleave(n, dim=1), value.repeat_interleave(n, dim=1), False
    return key, value, gqa


def lower_right_causal(query: torch.Tensor, key: torch.Tensor, value: torch.Tensor, scale: float) -> torch.Tensor:
    """Attention of ``query [B, H, Lq, D]`` over ``key``/``value [B, Hkv, Lk, D]`` (``Lk >= Lq``, ``Hkv`` divides
    ``H``) with the causal mask aligned at the bottom right: query ``i`` sees keys ``j <= i + Lk - Lq``. No mask
    tensor is made. Returns ``[B, H, Lq, D]``."""
    import torch.nn.functional as F

    lq, lk = query.shape[2], key.shape[2]
    if lk < lq:
        raise ValueError(f"bottom-right causal attention needs at least as many keys as queries, got {lk} < {lq}")
    if lq == lk:  # top left and bottom right coincide
        key, value, gqa = _heads_for_kernel(query, key, value, is_causal=True)
        return F.scaled_dot_product_attention(query, key, value, is_causal=True, scale=scale, enable_gqa=gqa)
    if query.device.type == "cpu":
        return PrefixCausal.apply(query, key, value, lk - lq, scale)
    return _cuda(query, key, value, scale)


def runs_attention(query: torch.Tensor, key: torch.Tensor, value: torch.Tensor, runs: list[tuple[int, int]],
                   scale: float) -> torch.Tensor:
    """Causal attention of a rank's queries ``[B, H, Sq, D]``, the global tokens of ``runs`` (contiguous ``[qs, qe)``
    ranges, in the order the queries hold them), over the gathered row's ``key``/``value [B, Hkv, S, D]``:
    each run's queries against keys ``[0, qe)``, bottom-right causal (:func:`lower_right_causal`).
    Returns ``[B, H, Sq, D]``."""
    outs, start = [], 0
    for qs, qe in runs:
        n = qe - qs
        outs.append(lower_right_causal(query[:, :, start:start + n], key[:, :, :qe], value[:, :, :qe], scale))
        start += n
    if start != query.shape[2]:
        raise ValueError(f"runs {runs} cover {start} queries; the rank holds {query.shape[2]}")
    return outs[0] if len(outs) == 1 else torch.cat(outs, dim=2)
