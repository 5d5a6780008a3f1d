"""Model FLOPs of each pipeline unit, from the HF config alone (no torch).

Convention (as in the PaLM / Megatron MFU papers): a matmul of ``[m, k] x [k, n]`` costs ``2 m k n``;
attention scores and the weighted sum are counted over the full sequence (``2 x 2 x seq x hidden``
per token, causal masking not discounted); element-wise work (norms, activations, softmax, the
embedding lookup) is not counted. Training costs three forwards (forward + backward = 2x forward);
recomputation under activation checkpointing is hardware work, not model work, so it is excluded
from :func:`model_flops_per_token` and MFU. These numbers feed the plan's cost model, the balanced
partition and the MFU metric: one definition for all of them.
"""
from __future__ import annotations

from hybridtrain.models.families import Family, mlp_width_of
from hybridtrain.models.units import Kind, Unit

TRAIN_FACTOR = 3
"""Forward + backward of a layer = 3 forwards (the backward computes input and weight gradients)."""


def _dims(family: Family, hf_config) -> tuple[int, int, int, int]:
    hidden = int(getattr(hf_config, family.hidden))
    heads = int(getattr(hf_config, family.heads))
    kv = getattr(hf_config, family.kv_heads, None) if family.kv_heads else None
    kv_heads = int(kv) if kv else heads
    head_dim = int(getattr(hf_config, "head_dim", None) or hidden // heads)
    return hidden, heads * head_dim, kv_heads * head_dim, mlp_width_of(family, hf_config)


def block_forward_flops(family: Family, hf_config, seq_len: int) -> float:
    """Forward FLOPs per token of one decoder block (grouped-query attention and gated MLPs aware)."""
    hidden, q_dim, kv_dim, width = _dims(family, hf_config)
    qkv = 2 * hidden * (q_dim + 2 * kv_dim)
    out = 2 * q_dim * hidden
    attention = 2 * 2 * seq_len * q_dim  # q @ k^T and probs @ v
    mlp_matrices = 3 if family.model_type == "llama" else 2  # gate, up, down (SwiGLU) vs fc, proj
    return float(qkv + out + attention + mlp_matrices * 2 * hidden * width)


def head_forward_flops(family: Family, hf_config, vocab_size: int) -> float:
    """Forward FLOPs per token of the LM head projection onto ``vocab_size`` logits."""
    return float(2 * int(getattr(hf_config, family.hidden)) * vocab_size)


def unit_forward_flops(unit: Unit, family: Family, hf_config, seq_len: int, vocab_size: int) -> float:
    """Forward FLOPs per token of one pipeline unit (:mod:`hybridtrain.models.units`)."""
    if unit.kind is Kind.BLOCK:
        return block_forward_flops(family, hf_config, seq_len)
    if unit.kind is Kind.HEAD:
        return head_forward_flops(family, hf_config, vocab_size)
    return 0.0  # lookups and norms: element-wise, not counted


def model_flops_per_token(family: Family, hf_config, seq_len: int, vocab_size: int) -> float:
    """Training (forward + backward) model FLOPs per token of the whole model, for MFU."""
    layers = int(getattr(hf_config, family.n_layers))
    forward = layers * block_forward_flops(family, hf_config, seq_len) + head_forward_flops(family, hf_config, vocab_size)
    return TRAIN_FACTOR * forward
