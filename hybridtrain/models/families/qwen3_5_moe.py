"""Qwen3.5-MoE (``Qwen3_5MoeForCausalLM``, ``model_type`` ``qwen3_5_moe_text``): Qwen3.5's blocks (three Gated
DeltaNet to one gated full attention, :mod:`hybridtrain.models.families.qwen3_5`) with a mixture-of-experts MLP in
every block: a softmax top-k router (always renormalised), fused 3-D routed experts and a shared expert scaled by
``sigmoid(shared_expert_gate(x))``, as Qwen2-MoE's (:mod:`hybridtrain.models.families.qwen2_moe`).

The token mixers split as Qwen3.5's; the routed experts over their width (tp) and over ``parallel.ep``, the router
and the shared expert's gate replicated outside the tensor-parallel region, the shared expert Megatron-style with
its own "f". Every block routes (no dense variant); the variants are the layer types.
"""
from hybridtrain.models.families.base import EXPERTS_RULES, SHARED_EXPERT_RULES, Family, LinearAttention, MoE
from hybridtrain.models.families.qwen3_5 import (GATED_DELTANET_PER_RANK, GATED_DELTANET_RULES,
                                                 LINEAR_ATTENTION_RULES, UNVERIFIED_LORA)

FAMILY = Family(
    model_type="qwen3_5_moe_text",
    embed="model.embed_tokens",
    blocks="model.layers",
    final_norm="model.norm",
    rotary_embed="model.rotary_emb",
    head="lm_head",
    hf_config_class="Qwen3_5MoeTextConfig",
    tp_rules={
        **{name: None for name in GATED_DELTANET_RULES},
        **EXPERTS_RULES,
        **SHARED_EXPERT_RULES,
    },
    input_copy=("self_attn", "mlp.shared_expert"),
    variant_rules={"linear_attention": LINEAR_ATTENTION_RULES},
    variant_input_copy={"linear_attention": ("linear_attn", "mlp.shared_expert")},
    variant_heads_per_rank_attrs={"linear_attention": GATED_DELTANET_PER_RANK},
    linear_attention=LinearAttention(),
    tp_divides=("linear_num_key_heads", "linear_num_value_heads"),
    unverified_lora={"linear_attn": UNVERIFIED_LORA},
    attn_implementations=("sdpa", "eager"),
    moe=MoE(shared_width="shared_expert_intermediate_size"),
    dropout_keys=("attention_dropout",),
)
