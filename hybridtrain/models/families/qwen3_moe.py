"""Qwen3-MoE (``Qwen3MoeForCausalLM``: Qwen3-30B-A3B, Qwen3-Coder-30B-A3B, Qwen3-235B-A22B): Qwen3's
attention (per-head q/k norm, explicit ``head_dim``) with a sparse mixture-of-experts MLP in every block.

The MLP is transformers' own ``Qwen3MoeSparseMoeBlock``: a softmax top-k router (``mlp.gate``, renormalised
when ``norm_topk_prob``) and a fused 3-D experts module (``mlp.experts``) run through transformers' experts
implementation. Under TP the router stays replicated and the experts are split over their MLP width
(the ``experts`` style, :mod:`hybridtrain.parallel.experts`); Megatron's "f" therefore goes on the
experts' inputs, not on the whole MLP (the router's gradient is complete on every rank). transformers'
plan entries for the experts (``packed_colwise``, ``moe_tp_experts``) become that one rule; those for a
dense MLP (``mlp.gate_proj`` ...) hold in the blocks with a dense MLP only (``mlp_only_layers``,
``decoder_sparse_step`` > 1: the ``dense`` variant, split like a dense model's MLP, "f" on ``mlp``). The router's
load-balancing loss (``output_router_logits``) is carried through the pipeline (:mod:`hybridtrain.models.moe`).
"""
from hybridtrain.models.families.base import DENSE_MLP_RULES, EXPERTS_RULES, Family, MoE


def dense_layers(hf_config) -> list[int]:
    """The blocks transformers builds with a dense MLP (``Qwen3MoeDecoderLayer``'s rule)."""
    step = int(hf_config.decoder_sparse_step)
    return [i for i in range(int(hf_config.num_hidden_layers))
            if i in hf_config.mlp_only_layers or not (hf_config.num_experts > 0 and (i + 1) % step == 0)]


def variants(hf_config) -> list[str]:
    """Each block's variant: ``moe`` (routed experts) or ``dense`` (a plain MLP, :func:`dense_layers`)."""
    dense = set(dense_layers(hf_config))
    return ["dense" if i in dense else "moe" for i in range(int(hf_config.num_hidden_layers))]


FAMILY = Family(
    model_type="qwen3_moe",
    embed="model.embed_tokens",
    blocks="model.layers",
    final_norm="model.norm",
    rotary_embed="model.rotary_emb",
    head="lm_head",
    hf_config_class="Qwen3MoeConfig",
    tp_rules={
        **EXPERTS_RULES,
        "mlp.gate_proj": None,
        "mlp.up_proj": None,
        "mlp.down_proj": None,
    },
    input_copy=("self_attn",),
    variant_rules={"dense": DENSE_MLP_RULES},
    variant_input_copy={"dense": ("self_attn", "mlp")},
    moe=MoE(dense_layers=dense_layers),
    block_variants=variants,
    dropout_keys=("attention_dropout",),
)
