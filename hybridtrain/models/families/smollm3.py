"""SmolLM3 (``SmolLM3ForCausalLM``): Llama's blocks without rotary on every ``no_rope_layer_interval``-th layer
(NoPE layers: ``config.no_rope_layers[i] == 0``, the attention skips ``apply_rotary_pos_emb``), optional sliding
windows on the rotary layers (``use_sliding_window``, ``config.layer_types``).

Every block gets the same rotary table, as in transformers (the NoPE attention reads its own ``use_rope`` and
ignores it); the split is transformers' plan as it stands.
"""
from hybridtrain.models.families.base import Family

FAMILY = Family(
    model_type="smollm3",
    embed="model.embed_tokens",
    blocks="model.layers",
    final_norm="model.norm",
    rotary_embed="model.rotary_emb",
    head="lm_head",
    hf_config_class="SmolLM3Config",
    dropout_keys=("attention_dropout",),
)
