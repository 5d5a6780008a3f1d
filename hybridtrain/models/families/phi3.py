"""Phi-3 (``Phi3ForCausalLM``): fused ``qkv_proj`` (q | k | v, unequal under grouped-query attention)
and fused ``gate_up_proj`` (gate | up), partial rotary, optional sliding window on every layer.

transformers' plan gathers the fused outputs (``colwise_gather_output``); here they are split
Megatron-style, each fused block on its own, so a rank keeps matching q, k, v heads and gate, up
columns. The attention reads ``config.num_attention_heads`` at forward time and keeps
``num_key_value_heads`` as an attribute: both become per-rank counts.
"""
from hybridtrain.models.families.base import Family, TPRule

FAMILY = Family(
    model_type="phi3",
    embed="model.embed_tokens",
    blocks="model.layers",
    final_norm="model.norm",
    rotary_embed="model.rotary_emb",
    head="lm_head",
    hf_config_class="Phi3Config",
    tp_rules={
        "self_attn.qkv_proj": TPRule("column", fused=("q", "kv", "kv")),
        "self_attn.o_proj": TPRule("row"),
        "mlp.gate_up_proj": TPRule("column", fused=2),
        "mlp.down_proj": TPRule("row"),
    },
    heads_per_rank_attrs=("self_attn.num_key_value_heads",),
    per_rank_config=("num_attention_heads", "num_key_value_heads"),
    dropout_keys=("attention_dropout", "resid_pdrop", "embd_pdrop"),
)
