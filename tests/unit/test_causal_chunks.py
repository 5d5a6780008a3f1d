"""The mask-free causal attention of a cp rank's chunks (``hybridtrain/parallel/causal_chunks.py``) against
attention with the dense bottom-right causal mask, outputs and gradients of query, key and value, in float64 (the
kernels differ only in summation order) and float32; grouped-query heads unrepeated, non-contiguous inputs (as HF
modules hand them over), a run that starts at token 0 and runs in the middle and at the end of a row."""
from __future__ import annotations

import pytest
import torch

from hybridtrain.parallel.causal_chunks import PrefixCausal, lower_right_causal, runs_attention
from hybridtrain.parallel.context import CPContext


def reference(q, k, v, scale):
    """Dense attention with the mask query ``i`` sees key ``j <= i + Lk - Lq`` (heads repeated)."""
    lq, lk = q.shape[2], k.shape[2]
    n = q.shape[1] // k.shape[1]
    k, v = k.repeat_interleave(n, 1), v.repeat_interleave(n, 1)
    s = (q @ k.transpose(-1, -2)) * scale
    i, j = torch.arange(lq)[:, None], torch.arange(lk)[None]
    return s.masked_fill(j > i + lk - lq, float("-inf")).softmax(-1) @ v


def _inputs(b, h, hk, lq, lk, d, dtype, seed=0):
    g = torch.Generator().manual_seed(seed)
    q = torch.randn(b, lq, h, d, dtype=dtype, generator=g).transpose(1, 2).requires_grad_()  # [B, H, Lq, D] strided
    k = torch.randn(b, lk, hk, d, dtype=dtype, generator=g).transpose(1, 2).requires_grad_()
    v = torch.randn(b, lk, hk, d, dtype=dtype, generator=g).transpose(1, 2).requires_grad_()
    return q, k, v, torch.randn(b, h, lq, d, dtype=dtype, generator=g)


def _compare(fn, q, k, v, up, scale):
    out = fn(q, k, v)
    out.backward(up)
    got = [out.detach()] + [t.grad.clone() for t in (q, k, v)]
    for t in (q, k, v):
        t.grad = None
    ref = reference(q, k, v, scale)
    ref.backward(up)
    want = [ref.detach()] + [t.grad.clone() for t in (q, k, v)]
    return max(float((a - b).abs().max()) for a, b in zip(got, want))


@pytest.mark.parametrize("dtype,tol", [(torch.float64, 1e-12), (torch.float32, 1e-5)], ids=["fp64", "fp32"])
@pytest.mark.parametrize("shape", [(2, 4, 2, 6, 10, 8), (1, 8, 8, 16, 48, 16), (2, 4, 1, 5, 5, 8), (1, 4, 2, 64, 320, 32)],
                         ids=["gqa", "mha", "square-mqa", "long-prefix"])
def test_lower_right_causal_equals_the_dense_mask(shape, dtype, tol):
    b, h, hk, lq, lk, d = shape
    q, k, v, up = _inputs(b, h, hk, lq, lk, d, dtype)
    scale = 0.3
    assert _compare(lambda *a: lower_right_causal(*a, scale), q, k, v, up, scale) < tol


def test_the_prefix_merge_runs_for_a_prefix_and_is_not_plain_sdpa():
    """The merge itself (not the square shortcut) ran, and a top-left causal mask would give another answer."""
    q, k, v, up = _inputs(1, 2, 2, 4, 12, 8, torch.float64)
    out = lower_right_causal(q, k, v, None)
    assert out.grad_fn is not None and "PrefixCausal" in type(out.grad_fn).__name__
    top_left = torch.nn.functional.scaled_dot_product_attention(q, k, v, is_causal=True)
    assert float((out - top_left).detach().abs().max()) > 1e-3
    assert float((out - reference(q, k, v, 8 ** -0.5)).detach().abs().max()) < 1e-12


@pytest.mark.parametrize("cp,rank", [(1, 0), (2, 0), (2, 1), (4, 0), (4, 3)])
def test_runs_attention_over_a_ranks_chunks_equals_full_causal_attention_at_its_rows(cp, rank):
    """A cp rank's two chunks against the whole row's keys give the full row's causal attention at the rank's
    tokens, in outputs and in the gradients of the rank's queries and of every key and value."""
    s = 32
    ctx = CPContext(rank=rank, size=cp)
    idx = ctx.indices(s)
    g = torch.Generator().manual_seed(3)
    q = torch.randn(2, 4, s, 8, dtype=torch.float64, generator=g).requires_grad_()
    k = torch.randn(2, 2, s, 8, dtype=torch.float64, generator=g).requires_grad_()
    v = torch.randn(2, 2, s, 8, dtype=torch.float64, generator=g).requires_grad_()
    up = torch.randn(2, 4, s // cp, 8, dtype=torch.float64, generator=g)
    out = runs_attention(q[:, :, idx], k, v, ctx.ranges(s), None)
    out.backward(up)
    got = [out.detach(), q.grad.clone(), k.grad.clone(), v.grad.clone()]
    for t in (q, k, v):
        t.grad = None
    ref = reference(q, k, v, 8 ** -0.5)[:, :, idx]
    ref.backward(up)
    want = [ref.detach(), q.grad, k.grad, v.grad]
    assert max(float((a - b).abs().max()) for a, b in zip(got, want)) < 1e-12


def test_ranges_are_the_indices_as_runs():
    for cp in (1, 2, 4):
        for rank in range(cp):
            ctx = CPContext(rank=rank, size=cp)
            runs = ctx.ranges(48)
            assert torch.equal(torch.cat([torch.arange(a, b) for a, b in runs]), ctx.indices(48))
    with pytest.raises(ValueError, match="2 x cp = 4"):
        CPContext(rank=0, size=2).ranges(6)


def test_runs_that_do_not_cover_the_queries_are_refused():
    q = torch.zeros(1, 2, 8, 4)
    with pytest.raises(ValueError, match="cover 4 queries"):
        runs_attention(q, q, q, [(0, 4)], None)
    with pytest.raises(ValueError, match="at least as many keys"):
        lower_right_causal(q, q[:, :, :4], q[:, :, :4], None)


def test_bf16_stays_close_and_keeps_the_kernels_fp32_log_sum_exp():
    q, k, v, up = _inputs(1, 4, 2, 32, 96, 16, torch.float32)
    out = PrefixCausal.apply(q.bfloat16(), k.bfloat16(), v.bfloat16(), 64, None)
    assert out.dtype == torch.bfloat16
    assert float((out.float() - reference(q, k, v, 0.25)).abs().max()) < 2e-2
