"""GPU tier: packed documents through a Gated DeltaNet layer (Qwen3.5) with flash-linear-attention's variable-length
kernels (``fla.modules.convolution.causal_conv1d`` and ``fla.ops.gated_delta_rule.chunk_gated_delta_rule`` with
``cu_seqlens``, fla's documented API) give each document what hybridtrain's per-document path gives it
(``hybridtrain/models/linear_attention.py``, the path every CPU test proves against transformers). The varlen
forward is written here from the layer's own weights, transformers' steps in transformers' order; transformers'
own forward of the packed row (no ``cu_seqlens``) must differ, so the comparison can fail. Needs CUDA and the
``flash-linear-attention`` package; bf16 (fla's chunked kernel takes no fp32), so the tolerance is bf16's. Written
from fla's documentation; never run in this repository's CI (no GPU there)."""
from __future__ import annotations

import importlib.util

import pytest
import torch
import torch.nn.functional as F

LENGTHS = (37, 64, 5, 90)
"""Documents of one packed row: shorter and longer than fla's 64-token chunk, one shorter than the conv window."""


def _need_fla() -> None:
    if not torch.cuda.is_available():
        pytest.skip("needs a CUDA GPU")
    if importlib.util.find_spec("fla") is None:
        pytest.skip("needs the flash-linear-attention package (pip install flash-linear-attention)")


def _layer():
    from transformers import AutoConfig
    from transformers.models.qwen3_5.modeling_qwen3_5 import Qwen3_5GatedDeltaNet

    cfg = AutoConfig.for_model("qwen3_5_text", hidden_size=64, num_hidden_layers=1, linear_num_key_heads=2,
                               linear_num_value_heads=4, linear_key_head_dim=32, linear_value_head_dim=16,
                               layer_types=["linear_attention"])
    torch.manual_seed(0)
    layer = Qwen3_5GatedDeltaNet(cfg, 0)
    with torch.no_grad():
        for p in layer.parameters():
            p.add_(0.1 * torch.randn_like(p))
    return layer.to(device="cuda", dtype=torch.bfloat16)


def _varlen(layer, x: torch.Tensor, cu_seqlens: torch.Tensor) -> torch.Tensor:
    """The layer on one packed row ``x [1, T, H]`` through fla's variable-length kernels."""
    from fla.modules.convolution import causal_conv1d
    from fla.ops.gated_delta_rule import chunk_gated_delta_rule

    t = x.shape[1]
    qkv = layer.in_proj_qkv(x)  # [1, T, 2 Hk dk + Hv dv]
    qkv = causal_conv1d(qkv, weight=layer.conv1d.weight.squeeze(1), bias=layer.conv1d.bias, activation="silu",
                        cu_seqlens=cu_seqlens)
    qkv = qkv[0] if isinstance(qkv, tuple) else qkv  # (y, final_state) in fla's newer releases
    q, k, v = torch.split(qkv, [layer.key_dim, layer.key_dim, layer.value_dim], dim=-1)
    q, k = (y.reshape(1, t, layer.num_k_heads, layer.head_k_dim) for y in (q, k))
    v = v.reshape(1, t, layer.num_v_heads, layer.head_v_dim)
    rep = layer.num_v_heads // layer.num_k_heads  # each key head serves rep consecutive value heads
    q, k = q.repeat_interleave(rep, dim=2), k.repeat_interleave(rep, dim=2)
    beta = layer.in_proj_b(x).sigmoid()  # [1, T, Hv]
    g = -layer.A_log.float().exp() * F.softplus(layer.in_proj_a(x).float() + layer.dt_bias)
    out, _ = chunk_gated_delta_rule(q, k, v, g=g, beta=beta, use_qk_l2norm_in_kernel=True, cu_seqlens=cu_seqlens)
    z = layer.in_proj_z(x).reshape(-1, layer.head_v_dim)
    out = layer.norm(out.reshape(-1, layer.head_v_dim), z).reshape(1, t, -1)
    return layer.out_proj(out)


def test_fla_varlen_gives_each_document_what_it_has_alone():
    _need_fla()
    from hybridtrain.models.linear_attention import Documents, run_per_document

    layer = _layer()
    pos = torch.cat([torch.arange(n) for n in LENGTHS])[None].cuda()  # [1, T]: the restarts mark the documents
    x = torch.randn(1, pos.shape[1], 64, device="cuda", dtype=torch.bfloat16)
    cu = torch.tensor([0, *torch.tensor(LENGTHS).cumsum(0).tolist()], device="cuda", dtype=torch.long)
    with torch.no_grad():
        alone = run_per_document(lambda y: layer(y), x, Documents.of(pos)).float()
        varlen = _varlen(layer, x, cu).float()
        mixed = layer(x).float()  # transformers' forward of the packed row: documents see their predecessors
    scale = alone.abs().max().item()
    assert (varlen - alone).abs().max().item() <= 3e-2 * scale
    later = slice(LENGTHS[0], None)  # the first document has no predecessor; every later one differs when mixed
    assert (mixed[:, later] - alone[:, later]).abs().max().item() > 1e-1 * scale
