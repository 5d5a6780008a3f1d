"""OLMo 3 (``Olmo3ForCausalLM``): OLMo 2's blocks (norms after attention and MLP, none before; RMSNorm on q and k
over the full projection width) with three sliding-window layers to one full layer (``config.layer_types``) and a
rotary table per layer type (its rotary embedding takes ``layer_type``; each block asks for its own,
:func:`~hybridtrain.models.stages.rotary_layer_type`).

The q/k norms are split as OLMo 2's (:data:`~hybridtrain.models.families.olmo2.ATTENTION_RULES`: q, k, v stay split
by heads and the norm's sum of squares is all-reduced over the TP group; transformers' plan gathers them).
"""
from hybridtrain.models.families.base import Family
from hybridtrain.models.families.olmo2 import ATTENTION_RULES

FAMILY = Family(
    model_type="olmo3",
    embed="model.embed_tokens",
    blocks="model.layers",
    final_norm="model.norm",
    rotary_embed="model.rotary_emb",
    head="lm_head",
    hf_config_class="Olmo3Config",
    tp_rules=dict(ATTENTION_RULES),
    dropout_keys=("attention_dropout",),
)
