"""OLMo 2 (``Olmo2ForCausalLM``): post-norm blocks (norms after attention and MLP, none before) and an
RMSNorm on q and k over the full projection width (all heads together).

transformers' plan gathers q, k and v for that norm (``colwise_gather_output``). Here they stay split
by heads, and the q/k norm becomes a sharded norm whose sum of squares is all-reduced over the TP
group in the forward and the backward (:class:`~hybridtrain.parallel.layers.ShardedRMSNorm`).
"""
from hybridtrain.models.families.base import Family, TPRule


def sharded_qk_norm(module, weight_shard, full_width: int, tp):
    """``Olmo2RMSNorm`` over a width split across the TP group (its weight: this rank's slice)."""
    from hybridtrain.parallel.layers import ShardedRMSNorm

    return ShardedRMSNorm(weight_shard, module.variance_epsilon, full_width, tp)


ATTENTION_RULES = {
    "self_attn.q_proj": TPRule("column"),
    "self_attn.k_proj": TPRule("column"),
    "self_attn.v_proj": TPRule("column"),
    "self_attn.o_proj": TPRule("row"),
    "self_attn.q_norm": TPRule("norm", replace=sharded_qk_norm),
    "self_attn.k_norm": TPRule("norm", replace=sharded_qk_norm),
}
"""OLMo 2's attention: Megatron q/k/v/o, and q/k norms over the full projection width, sharded (OLMoE's too)."""


FAMILY = Family(
    model_type="olmo2",
    embed="model.embed_tokens",
    blocks="model.layers",
    final_norm="model.norm",
    rotary_embed="model.rotary_emb",
    head="lm_head",
    hf_config_class="Olmo2Config",
    tp_rules=dict(ATTENTION_RULES),
    dropout_keys=("attention_dropout",),
)
