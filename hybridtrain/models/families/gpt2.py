"""GPT-2 (``GPT2LMHeadModel``): learned positions, fused ``c_attn`` (q | k | v) as HF ``Conv1D``.

transformers ships no ``base_model_tp_plan`` for GPT-2, so the plan is written here.
"""
from hybridtrain.models.families.base import Family, TPRule

FAMILY = Family(
    model_type="gpt2",
    embed="transformer.wte",
    position_embed="transformer.wpe",
    blocks="transformer.h",
    final_norm="transformer.ln_f",
    head="lm_head",
    attention="attn",
    tp_rules={
        "attn.c_attn": TPRule("column", conv1d=True, fused=3),
        "attn.c_proj": TPRule("row", conv1d=True),
        "mlp.c_fc": TPRule("column", conv1d=True),
        "mlp.c_proj": TPRule("row", conv1d=True),
    },
    input_copy=("attn", "mlp"),
    heads_per_rank_attrs=("attn.split_size", "attn.num_heads"),
    embed_dropout="embd_pdrop",
    dropout_keys=("resid_pdrop", "embd_pdrop", "attn_pdrop", "summary_first_dropout"),
    n_layers="n_layer",
    hidden="n_embd",
    heads="n_head",
    kv_heads=None,
    mlp_width="n_inner",  # None in HF means 4 * n_embd; see mlp_width_of()
    max_positions="n_positions",
)
