"""Model FLOPs of each pipeline unit, from the model's real linear shapes.

Convention (as in the PaLM / Megatron MFU papers): a matmul of ``[m, k] x [k, n]`` costs ``2 m k n``;
attention scores and the weighted sum are counted over the full sequence (``2 x 2 x seq x hidden``
per token, causal masking not discounted); element-wise work (norms, activations, softmax, the
embedding lookup) is not counted. Training costs three forwards (forward + backward = 2x forward);
recomputation under activation checkpointing is hardware work, not model work, so it is excluded
from :func:`model_flops_per_token` and MFU. These numbers feed the plan's cost model, the balanced
partition and the MFU metric: one definition for all of them.
"""
from __future__ import annotations


from hybridtrain.models.families import Family
from hybridtrain.models.families.base import attention_head_dims
from hybridtrain.models.units import Kind, Unit

TRAIN_FACTOR = 3
"""Forward + backward of a layer = 3 forwards (the backward computes input and weight gradients)."""


def block_forward_flops(family: Family, hf_config, seq_len: int, linear: float, variant: str | None = None) -> float:
    """Forward FLOPs per token of one decoder block: its linears' ``linear`` FLOPs
    (:func:`hybridtrain.models.shapes.linear_flops`) plus the attention scores and the weighted sum over
    the sequence (``2 x seq x heads x (qk_dim + v_dim)``: ``2 x 2 x seq x heads x head_dim`` where the value head is
    as wide as the query/key head, :func:`~hybridtrain.models.families.base.attention_head_dims`). A linear-attention
    block of ``variant`` (Gated DeltaNet) has no scores over the sequence: its recurrence reads the ``[dk, dv]``
    state of each value head, updates it by a rank-one term and reads it again per token (``3 x 2 x Hv x dk x dv``,
    the recurrent form; the chunked kernel's intra-chunk products are not counted)."""
    if family.is_linear_attention(variant):
        state = (int(hf_config.linear_num_value_heads) * int(hf_config.linear_key_head_dim)
                 * int(hf_config.linear_value_head_dim))
        return linear + 3 * 2 * state
    qk, v = attention_head_dims(family, hf_config)
    heads = int(getattr(hf_config, family.heads))
    return linear + 2 * seq_len * heads * (qk + v)  # q @ k^T and probs @ v


def head_forward_flops(family: Family, hf_config, vocab_size: int) -> float:
    """Forward FLOPs per token of the LM head projection onto ``vocab_size`` logits."""
    return float(2 * int(getattr(hf_config, family.hidden)) * vocab_size)


def unit_forward_flops(unit: Unit, family: Family, hf_config, seq_len: int, vocab_size: int,
                       linear: float = 0.0) -> float:
    """Forward FLOPs per token of one pipeline unit (:mod:`hybridtrain.models.units`); ``linear``: the
    linear FLOPs of the unit's block variant (:class:`hybridtrain.models.shapes.BlockShapes`), needed for blocks."""
    if unit.kind is Kind.BLOCK:
        return block_forward_flops(family, hf_config, seq_len, linear, unit.variant)
    if unit.kind is Kind.HEAD:
        return head_forward_flops(family, hf_config, vocab_size)
    return 0.0  # lookups and norms: element-wise, not counted


def model_flops_per_token(family: Family, hf_config, seq_len: int, vocab_size: int) -> float:
    """Training (forward + backward) model FLOPs per token of the whole model, for MFU."""
    from hybridtrain.models.shapes import block_shapes

    from hybridtrain.models.units import block_variants

    linear = block_shapes(family, hf_config).linear_flops
    blocks = sum(block_forward_flops(family, hf_config, seq_len, linear[v], v) for v in block_variants(family, hf_config))
    return TRAIN_FACTOR * (blocks + head_forward_flops(family, hf_config, vocab_size))
