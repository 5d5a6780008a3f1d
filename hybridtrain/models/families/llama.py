"""Llama (``LlamaForCausalLM``): the rotary, grouped-query-attention, SwiGLU reference family.

Its tensor-parallel plan is transformers' ``LlamaConfig.base_model_tp_plan`` as it stands.
"""
from hybridtrain.models.families.base import Family

FAMILY = Family(
    model_type="llama",
    embed="model.embed_tokens",
    blocks="model.layers",
    final_norm="model.norm",
    rotary_embed="model.rotary_emb",
    head="lm_head",
    hf_config_class="LlamaConfig",
    dropout_keys=("attention_dropout",),
)
