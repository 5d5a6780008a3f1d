"""GPT-NeoX / Pythia (``GPTNeoXForCausalLM``): fused ``query_key_value`` laid out per head
(``[h0: q k v, h1: q k v, ...]``, so a contiguous split of its rows gives each rank whole heads),
partial rotary (``rotary_pct``), parallel residual (``use_parallel_residual``), LayerNorms, dropout
after the embedding, and an untied head that ``save_pretrained`` writes as ``embed_out.weight``."""
from hybridtrain.models.families.base import Family

FAMILY = Family(
    model_type="gpt_neox",
    embed="gpt_neox.embed_in",
    blocks="gpt_neox.layers",
    final_norm="gpt_neox.final_layer_norm",
    rotary_embed="gpt_neox.rotary_emb",
    head="lm_head",
    attention="attention",
    hf_config_class="GPTNeoXConfig",
    input_copy=("attention", "mlp"),
    embed_dropout="hidden_dropout",
    dropout_keys=("hidden_dropout", "attention_dropout"),
    checkpoint_names={"lm_head.weight": "embed_out.weight"},
    kv_heads=None,
)
