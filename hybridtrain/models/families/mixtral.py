"""Mixtral (``MixtralForCausalLM``: Mixtral-8x7B, 8x22B): Mistral's attention with a mixture-of-experts MLP
in every block (softmax top-k router, always renormalised; fused 3-D experts of width ``intermediate_size``).

As Qwen3-MoE (:mod:`hybridtrain.models.families.qwen3_moe`): the router replicated, the experts split over
their width (the ``experts`` style) and over ``parallel.ep``, the router aux loss carried through the
pipeline. Published checkpoints name the MLP ``block_sparse_moe`` and its experts ``w1``/``w3``/``w2``;
transformers' conversion table says how they map to ``mlp`` and the fused tensors, and the reader uses it
(:mod:`hybridtrain.models.weights`). ``router_jitter_noise`` multiplies the hidden states by random noise in
training (layout-dependent, like a dropout): it is a dropout key (0 in the self-check's twin).
"""
from hybridtrain.models.families.base import EXPERTS_RULES, Family, MoE

FAMILY = Family(
    model_type="mixtral",
    embed="model.embed_tokens",
    blocks="model.layers",
    final_norm="model.norm",
    rotary_embed="model.rotary_emb",
    head="lm_head",
    hf_config_class="MixtralConfig",
    tp_rules=dict(EXPERTS_RULES),
    input_copy=("self_attn",),
    moe=MoE(num_experts="num_local_experts", width="intermediate_size"),
    mlp_width="intermediate_size",
    dropout_keys=("attention_dropout", "router_jitter_noise"),
)
