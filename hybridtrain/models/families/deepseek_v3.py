"""DeepSeek-V3 (``DeepseekV3ForCausalLM``: DeepSeek-V3, DeepSeek-R1, Kimi-K2 style configs): multi-head latent
attention (MLA), ``first_k_dense_replace`` leading blocks with a dense MLP, the others a mixture of experts with a
group-limited sigmoid router, fused 3-D routed experts and shared experts every token runs.

Attention under tensor parallelism, split by heads: the low-rank down-projections and their norms
(``q_a_proj``, ``q_a_layernorm``, ``kv_a_proj_with_mqa``, ``kv_a_layernorm``) stay whole on every rank inside the
tensor-parallel region (after the attention's "f"): each rank runs them on the full hidden states, but only its own
heads read their outputs, so their weight gradients are partial and are summed over the group (``grad_sum``, what
transformers' ``mla_kv_a_proj`` style stands for; the two linears as ``grad_sum_linear``, so that LoRA adapts them
as peft's ``all-linear`` does, their adapters' gradients summed the same way). The up-projections (``q_b_proj``, or ``q_proj`` when
``q_lora_rank`` is ``None``, and ``kv_b_proj``) are column-parallel by heads, ``o_proj`` row-parallel. transformers'
forward views every head tensor with ``-1`` heads, so no head count needs dividing; the rotary embedding acts on
the ``qk_rope_head_dim`` part of each head and the shared ``k_rot``, both per token, so it is unchanged.

The MLP: transformers' own ``DeepseekV3MoE``. Its router (``mlp.gate``, ``DeepseekV3TopkRouter``: sigmoid
scores, ``e_score_correction_bias`` for the choice, the best ``topk_group`` of ``n_group`` groups, renormalised
when ``norm_topk_prob``, times ``routed_scaling_factor``) returns ``(router_logits, top_k_weights, top_k_index)``
and stays replicated; the experts (``mlp.experts``) are split like every MoE family's (the ``experts`` style, and
over ``parallel.ep``); the shared experts (``mlp.shared_experts``, one SwiGLU of width ``n_shared_experts x
moe_intermediate_size``) are split Megatron-style with their own "f". The leading dense blocks are the ``dense``
variant (their MLP split like a dense model's, "f" on ``mlp``). The router's ``e_score_correction_bias`` is a
buffer (no gradient; transformers never updates it): read from the checkpoint, written back into ``hf/`` and the
export (:attr:`~hybridtrain.models.families.base.Family.saved_buffers`). transformers keeps the router in fp32
(``_keep_in_fp32_modules_strict``), so runs are fp32 (the plan refuses 16-bit precisions).

transformers' ``DeepseekV3ForCausalLM`` loss is the token cross-entropy only: it has no router load-balancing
term (``output_router_logits`` records the router logits but never adds ``load_balancing_loss_func``), and
neither has hybridtrain's (:attr:`~hybridtrain.models.families.base.MoE.aux_loss`). Multi-token prediction layers
(``num_nextn_predict_layers``) are not built by transformers' causal-LM model, so not trained here either.
"""
from hybridtrain.models.families.base import DENSE_MLP_RULES, EXPERTS_RULES, Family, MoE, TPRule


def dense_layers(hf_config) -> list[int]:
    """The leading ``first_k_dense_replace`` blocks, which transformers builds with a dense MLP."""
    return list(range(min(int(hf_config.first_k_dense_replace or 0), int(hf_config.num_hidden_layers))))


def variants(hf_config) -> list[str]:
    """Each block's variant: ``dense`` (the first ``first_k_dense_replace``) or ``moe``."""
    dense = set(dense_layers(hf_config))
    return ["dense" if i in dense else "moe" for i in range(int(hf_config.num_hidden_layers))]


SHARED = ("mlp.shared_experts.gate_proj", "mlp.shared_experts.up_proj", "mlp.shared_experts.down_proj")

FAMILY = Family(
    model_type="deepseek_v3",
    embed="model.embed_tokens",
    blocks="model.layers",
    final_norm="model.norm",
    rotary_embed="model.rotary_emb",
    head="lm_head",
    hf_config_class="DeepseekV3Config",
    tp_rules={
        **EXPERTS_RULES,
        "self_attn.q_a_proj": TPRule("grad_sum_linear"),
        "self_attn.q_a_layernorm": TPRule("grad_sum"),
        "self_attn.kv_a_proj_with_mqa": TPRule("grad_sum_linear"),  # transformers' "mla_kv_a_proj"
        "self_attn.kv_a_layernorm": TPRule("grad_sum"),
        "mlp.gate_proj": None,
        "mlp.up_proj": None,
        "mlp.down_proj": None,
    },
    input_copy=("self_attn", "mlp.shared_experts"),
    variant_rules={"dense": {**DENSE_MLP_RULES, **{name: None for name in SHARED}}},
    variant_input_copy={"dense": ("self_attn", "mlp")},
    saved_buffers=("mlp.gate.e_score_correction_bias",),
    attn_implementations=("sdpa", "eager"),
    context_parallel=("its multi-head latent attention has value heads narrower than its query/key heads "
                      "(v_head_dim vs qk_nope_head_dim + qk_rope_head_dim), which the context-parallel attention "
                      "kernels do not take"),
    moe=MoE(num_experts="n_routed_experts", shared_experts="n_shared_experts", dense_layers=dense_layers,
            aux_loss=False),
    block_variants=variants,
    dropout_keys=("attention_dropout",),
)
