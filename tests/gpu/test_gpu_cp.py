"""GPU tier: context parallelism's FlashAttention 2 path (``model.attn_implementation=flash_attention_2`` with
``parallel.cp`` > 1, issue 31.6). Each rank's queries against the gathered keys go to flash-attn's
variable-length kernel as one sequence per piece of a document in the rank's chunks
(``hybridtrain.parallel.context_parallel.flash_varlen_attention``); here, through transformers' own
``flash_attention_forward`` on a real attention module, they must equal the dense-mask attention of the same
queries and keys (the mask of ``cp_attention_mask``), for every rank of cp = 2 and 4, packed documents crossing
the chunks, with and without a sliding window. The CPU tier checks the same pieces against the kernel's
documented semantics (tests/unit/test_context_parallel.py); this is the kernel itself (bottom-right causal
alignment, window, grouped-query heads). bf16 in, compared with fp32 attention of the same bf16 values."""
from __future__ import annotations

import importlib.util
import math

import pytest
import torch

S = 64


def _need_flash() -> None:
    if not torch.cuda.is_available():
        pytest.skip("needs a CUDA GPU")
    if importlib.util.find_spec("flash_attn") is None:
        pytest.skip("needs the flash-attn package (pip install flash-attn)")


def _positions(rows: str) -> torch.Tensor:
    if rows == "unpacked":
        return torch.arange(S).expand(2, S)
    docs = [[13, 20, 9, 22], [5, 40, 19]]  # lengths: boundaries inside the chunks of cp = 2 (16) and 4 (8)
    return torch.tensor([[p for n in row for p in range(n)] for row in docs])


@pytest.mark.parametrize("rows", ["unpacked", "packed"])
@pytest.mark.parametrize("window", [None, 7])
@pytest.mark.parametrize("cp", [2, 4])
def test_flash_pieces_equal_the_masked_attention_on_the_gpu(rows, window, cp):
    _need_flash()
    from torch.nn.functional import scaled_dot_product_attention
    from transformers import LlamaConfig
    from transformers.integrations.flash_attention import flash_attention_forward
    from transformers.models.llama.modeling_llama import LlamaAttention

    from hybridtrain.parallel.context import chunk_indices
    from hybridtrain.parallel.context_parallel import cp_attention_mask, flash_varlen_attention, register_attention

    heads, kv_heads, dim = 8, 2, 64
    config = LlamaConfig(hidden_size=heads * dim, num_attention_heads=heads, num_key_value_heads=kv_heads,
                         num_hidden_layers=1, attn_implementation="flash_attention_2")
    config._attn_implementation = register_attention()  # as ModelBuilder.for_run sets it at cp > 1 (gpu-review-3 #1)
    module = LlamaAttention(config, layer_idx=0).to("cuda", torch.bfloat16)
    positions = _positions(rows).cuda()
    torch.manual_seed(3)
    key = torch.randn(2, kv_heads, S, dim, device="cuda", dtype=torch.bfloat16)
    value = torch.randn(2, kv_heads, S, dim, device="cuda", dtype=torch.bfloat16)
    for rank in range(cp):
        idx = chunk_indices(S, cp, rank).cuda()
        query = torch.randn(2, heads, len(idx), dim, device="cuda", dtype=torch.bfloat16)
        got, _ = flash_varlen_attention(flash_attention_forward, module, query, key, value, positions, idx,
                                        sliding_window=window, scaling=1 / math.sqrt(dim), dropout=0.0)
        mask = cp_attention_mask(positions, idx, window, torch.float32, additive=False)
        want = scaled_dot_product_attention(query.float(), key.float().repeat_interleave(heads // kv_heads, 1),
                                            value.float().repeat_interleave(heads // kv_heads, 1),
                                            attn_mask=mask).transpose(1, 2)  # [B, Sq, H, D]
        assert torch.isfinite(got).all()
        err = (got.float() - want).abs().max().item()
        assert err <= 2e-2, f"rank {rank}: flash pieces differ from the masked attention by {err}"


@pytest.mark.parametrize("heads", [(8, 8), (8, 2)], ids=["mha", "gqa"])
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float32], ids=["bf16", "fp32"])
def test_mask_free_causal_chunks_equal_the_dense_mask_on_the_gpu(heads, dtype):
    """Plain causal sdpa under cp (``hybridtrain.parallel.causal_chunks``): on CUDA each chunk goes through torch's
    lower-right causal bias (FlashAttention or memory-efficient attention, no mask tensor). Outputs and the
    gradients of query, key and value equal fp32 attention with the dense bottom-right mask; in bf16 at 32k keys
    the forward and backward allocate less than one dense boolean ``[Lq, Lk]`` mask would."""
    if not torch.cuda.is_available():
        pytest.skip("needs a CUDA GPU")
    from hybridtrain.parallel.causal_chunks import lower_right_causal

    h, hk = heads
    g = torch.Generator(device="cuda").manual_seed(0)

    def rand(*shape):
        return torch.randn(*shape, device="cuda", generator=g).to(dtype).requires_grad_()

    lq, lk, d = 256, 1024, 64
    q, k, v = rand(2, h, lq, d), rand(2, hk, lk, d), rand(2, hk, lk, d)
    up = torch.randn(2, h, lq, d, device="cuda", generator=g).to(dtype)
    out = lower_right_causal(q, k, v, None)
    out.backward(up)
    got = [out.float(), q.grad.float(), k.grad.float(), v.grad.float()]
    qf, kf, vf = (t.detach().float().requires_grad_() for t in (q, k, v))
    n = h // hk
    s = (qf @ kf.repeat_interleave(n, 1).transpose(-1, -2)) / math.sqrt(d)
    i, j = torch.arange(lq, device="cuda")[:, None], torch.arange(lk, device="cuda")[None]
    ref = s.masked_fill(j > i + lk - lq, float("-inf")).softmax(-1) @ vf.repeat_interleave(n, 1)
    ref.backward(up.float())
    want = [ref, qf.grad, kf.grad, vf.grad]
    tol = 3e-2 if dtype is torch.bfloat16 else 2e-3
    for a, b in zip(got, want):
        assert float((a - b).abs().max()) < tol * max(1.0, float(b.abs().max()))

    if dtype is not torch.bfloat16:
        return  # fp32 takes memory-efficient attention, with grouped heads repeated: its memory is not the point
    lq, lk = 8192, 32768  # a dense boolean mask alone would be 256 MiB; everything else here is linear, ~100 MiB
    q, k, v = rand(1, h, lq, d), rand(1, hk, lk, d), rand(1, hk, lk, d)
    torch.cuda.synchronize()
    torch.cuda.reset_peak_memory_stats()
    base = torch.cuda.memory_allocated()
    lower_right_causal(q, k, v, None).sum().backward()
    torch.cuda.synchronize()
    assert torch.cuda.max_memory_allocated() - base < lq * lk, "the CUDA path materialized a mask"


@pytest.mark.parametrize("lq", [512, 256], ids=["square", "prefix"])
def test_fp32_grouped_heads_never_fall_back_to_the_math_kernel(lq):
    """GPU review 3, finding 9: cp rank 0's square chunk (``lq == lk``) passed ``enable_gqa=True`` in fp32, which
    flash refuses and the memory-efficient kernel does not take, so torch ran math (the whole score matrix kept).
    With math switched off the call must still run, and equal the math kernel's result."""
    if not torch.cuda.is_available():
        pytest.skip("needs a CUDA GPU")
    from torch.nn.attention import SDPBackend, sdpa_kernel

    from hybridtrain.parallel.causal_chunks import lower_right_causal

    g = torch.Generator(device="cuda").manual_seed(1)
    q = torch.randn(2, 8, lq, 64, device="cuda", generator=g)
    k, v = torch.randn(2, 2, 512, 64, device="cuda", generator=g), torch.randn(2, 2, 512, 64, device="cuda", generator=g)
    with sdpa_kernel([SDPBackend.FLASH_ATTENTION, SDPBackend.EFFICIENT_ATTENTION]):
        fused = lower_right_causal(q, k, v, None)
    with sdpa_kernel([SDPBackend.MATH]):
        ref = lower_right_causal(q, k, v, None)
    assert float((fused - ref).abs().max()) < 1e-4
