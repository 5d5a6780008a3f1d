"""Qwen2-MoE (``Qwen2MoeForCausalLM``: Qwen1.5-MoE-A2.7B, Qwen2-57B-A14B): Qwen2's attention (biases on q,
k, v; optional sliding-window layers) with a mixture-of-experts MLP: a softmax top-k router (renormalised
when ``norm_topk_prob``), fused 3-D routed experts, and a **shared expert** every token runs, scaled by
``sigmoid(shared_expert_gate(x))``.

The routed experts as Qwen3-MoE's (:mod:`hybridtrain.models.families.qwen3_moe`). The shared expert is a
plain SwiGLU MLP split Megatron-style (gate and up column-wise, down row-wise), with its own "f" on its
input; its gate (``Linear(H, 1)``) stays replicated outside the tensor-parallel region, like the router
(transformers' plan has no entries for either); the ``replicated`` rule names the gate so that LoRA's
``all-linear`` adapts it, as peft does. Blocks with a dense MLP (``mlp_only_layers``,
``decoder_sparse_step`` > 1: the ``dense`` variant) have neither experts nor a shared expert: their MLP is
split like a dense model's.
"""
from hybridtrain.models.families.base import (DENSE_MLP_RULES, EXPERTS_RULES, NO_SHARED_EXPERT, SHARED_EXPERT_RULES,
                                              Family, MoE)
from hybridtrain.models.families.qwen3_moe import dense_layers, variants

FAMILY = Family(
    model_type="qwen2_moe",
    embed="model.embed_tokens",
    blocks="model.layers",
    final_norm="model.norm",
    rotary_embed="model.rotary_emb",
    head="lm_head",
    hf_config_class="Qwen2MoeConfig",
    tp_rules={
        **EXPERTS_RULES,
        "mlp.gate_proj": None,
        "mlp.up_proj": None,
        "mlp.down_proj": None,
        **SHARED_EXPERT_RULES,
    },
    input_copy=("self_attn", "mlp.shared_expert"),
    variant_rules={"dense": {**DENSE_MLP_RULES, **NO_SHARED_EXPERT}},
    variant_input_copy={"dense": ("self_attn", "mlp")},
    moe=MoE(dense_layers=dense_layers, shared_width="shared_expert_intermediate_size"),
    block_variants=variants,
    dropout_keys=("attention_dropout",),
)
