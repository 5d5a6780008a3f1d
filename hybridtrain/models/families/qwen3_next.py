"""Qwen3-Next (``Qwen3NextForCausalLM``, ``model_type`` ``qwen3_next``): Qwen3.5's predecessor, the same hybrid of
Gated DeltaNet and gated full attention (:mod:`hybridtrain.models.families.qwen3_5`) with Qwen2-MoE's routed and
shared experts (:mod:`hybridtrain.models.families.qwen2_moe`), and fused Gated DeltaNet input projections.

``in_proj_qkvz`` holds, key-head group by key-head group, ``[q_g (dk) | k_g (dk) | v_g (r dv) | z_g (r dv)]`` with
``r = Hv / Hk`` value heads per key head (transformers' ``fix_query_key_value_ordering`` views it as
``[..., Hk, 2 dk + 2 r dv]``), and ``in_proj_ba`` likewise ``[b_g (r) | a_g (r)]``. So a contiguous split of their
rows gives rank ``r`` whole key-head groups with their q, k, v, z, b and a: column-parallel as they stand (fused = 1),
the same heads as the rest of the layer's split. The conv runs over ``cat(q, k, v)`` after the reordering, so its
channels split block by block (q | k | v) as Qwen3.5's. transformers' forward reads ``num_k_heads`` and
``num_v_heads`` for its views: divided by tp with ``key_dim`` and ``value_dim``.

Blocks with a dense MLP (``mlp_only_layers``, ``decoder_sparse_step`` > 1) are the variants ``linear_attention_dense``
and ``full_attention_dense``: their MLP split like a dense model's, "f" on ``mlp``.
"""
from hybridtrain.models.families.base import (DENSE_MLP_RULES, EXPERTS_RULES, NO_SHARED_EXPERT, SHARED_EXPERT_RULES,
                                              Family, LinearAttention, MoE, TPRule)
from hybridtrain.models.families.qwen3_5 import FULL_ATTENTION, GATED_DELTANET_PER_RANK, UNVERIFIED_LORA
from hybridtrain.models.families.qwen3_moe import dense_layers

GATED_DELTANET_RULES: dict = {
    "linear_attn": TPRule("heads"),  # its own A_log [Hv] and dt_bias [Hv]
    "linear_attn.in_proj_qkvz": TPRule("column"),  # key-head groups [q | k | v | z] laid out one after another
    "linear_attn.in_proj_ba": TPRule("column"),  # key-head groups [b | a]
    "linear_attn.conv1d": TPRule("channels", fused=("linear_k", "linear_k", "linear_v")),
    "linear_attn.norm": TPRule("grad_sum"),
    "linear_attn.out_proj": TPRule("row"),
}
"""Qwen3-Next's Gated DeltaNet split by key-head groups (the module docstring)."""

LINEAR = {**GATED_DELTANET_RULES, **{name: None for name in FULL_ATTENTION}}
DENSE = {**DENSE_MLP_RULES, **NO_SHARED_EXPERT}


def variants(hf_config) -> list[str]:
    """Each block's variant: its layer type, with ``_dense`` where its MLP is dense (:func:`dense_layers`)."""
    dense = set(dense_layers(hf_config))
    return [f"{kind}_dense" if i in dense else kind for i, kind in enumerate(hf_config.layer_types)]


FAMILY = Family(
    model_type="qwen3_next",
    embed="model.embed_tokens",
    blocks="model.layers",
    final_norm="model.norm",
    rotary_embed="model.rotary_emb",
    head="lm_head",
    hf_config_class="Qwen3NextConfig",
    tp_rules={
        **{name: None for name in GATED_DELTANET_RULES},
        **EXPERTS_RULES,
        "mlp.gate_proj": None,
        "mlp.up_proj": None,
        "mlp.down_proj": None,
        **SHARED_EXPERT_RULES,
    },
    input_copy=("self_attn", "mlp.shared_expert"),
    block_variants=variants,
    variant_rules={"linear_attention": LINEAR, "linear_attention_dense": {**LINEAR, **DENSE},
                   "full_attention_dense": DENSE},
    variant_input_copy={"linear_attention": ("linear_attn", "mlp.shared_expert"),
                        "linear_attention_dense": ("linear_attn", "mlp"), "full_attention_dense": ("self_attn", "mlp")},
    variant_heads_per_rank_attrs={"linear_attention": GATED_DELTANET_PER_RANK,
                                  "linear_attention_dense": GATED_DELTANET_PER_RANK},
    linear_attention=LinearAttention(),
    tp_divides=("linear_num_key_heads", "linear_num_value_heads"),
    unverified_lora={"linear_attn": UNVERIFIED_LORA},
    attn_implementations=("sdpa", "eager"),
    moe=MoE(dense_layers=dense_layers, shared_width="shared_expert_intermediate_size"),
    dropout_keys=("attention_dropout",),
)
