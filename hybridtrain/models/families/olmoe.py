"""OLMoE (``OlmoeForCausalLM``: OLMoE-1B-7B): OLMo's attention with an RMSNorm on q and k over the full
projection width, and a mixture-of-experts MLP in every block (softmax top-k router, renormalised when
``norm_topk_prob``; fused 3-D experts of width ``intermediate_size``).

transformers' plan gathers q, k and v for the full-width norm; here they stay split by heads and the norm is
sharded as OLMo 2's (:func:`hybridtrain.models.families.olmo2.sharded_qk_norm`). The experts as Qwen3-MoE's
(:mod:`hybridtrain.models.families.qwen3_moe`).
"""
from hybridtrain.models.families.base import EXPERTS_RULES, Family, MoE
from hybridtrain.models.families.olmo2 import ATTENTION_RULES

FAMILY = Family(
    model_type="olmoe",
    embed="model.embed_tokens",
    blocks="model.layers",
    final_norm="model.norm",
    rotary_embed="model.rotary_emb",
    head="lm_head",
    hf_config_class="OlmoeConfig",
    tp_rules={
        **ATTENTION_RULES,
        **EXPERTS_RULES,
    },
    input_copy=("self_attn",),
    moe=MoE(width="intermediate_size"),
    mlp_width="intermediate_size",
    dropout_keys=("attention_dropout",),
)
