"""Qwen2 / Qwen2.5 (``Qwen2ForCausalLM``): Llama with biases on q, k and v (split with their rows, as
column-parallel biases) and optional sliding-window layers (``use_sliding_window``: layers from
``max_window_layers`` on; ``config.layer_types`` says which)."""
from hybridtrain.models.families.base import Family

FAMILY = Family(
    model_type="qwen2",
    embed="model.embed_tokens",
    blocks="model.layers",
    final_norm="model.norm",
    rotary_embed="model.rotary_emb",
    head="lm_head",
    hf_config_class="Qwen2Config",
    dropout_keys=("attention_dropout",),
)
