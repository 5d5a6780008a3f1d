"""Gemma 3's language model (``Gemma3ForCausalLM``, ``model_type`` ``gemma3_text``): Gemma 2's blocks (norms before
and after attention and MLP, (1 + w) RMSNorm, GeGLU, Gemma's sqrt(hidden) embedding scale, tied head, attention
scaled by ``query_pre_attn_scalar ** -0.5``) with five sliding-window layers to one global layer
(``config.layer_types``), a rotary base per layer type (``rope_parameters["sliding_attention"]`` /
``["full_attention"]``: its rotary embedding takes ``layer_type``, and each block asks for its own,
:func:`~hybridtrain.models.stages.rotary_layer_type`) and Qwen3's per-head RMSNorm on q and k in place of Gemma 2's
attention soft-cap.

The split is transformers' plan as it stands (the per-head q/k norms replicated, their gradients summed over tp).
Unlike Gemma 2 it runs sdpa (its attention has no soft-cap; flash attention as for the other families, not run on a
GPU here). The published Gemma 3 folders (4B and up) are the vision-language ``Gemma3ForConditionalGeneration``
(``model_type`` ``gemma3``): the plan refuses them and names ``python -m hybridtrain.extract_text``, which writes the
language model as a ``Gemma3ForCausalLM`` folder.
``use_bidirectional_attention`` (Gemma 3 as an embedding model) is refused by the plan: it is not a causal LM.
"""
from hybridtrain.models.families.base import Family

BIDIRECTIONAL = ("Gemma 3 with bidirectional attention is an embedding model (every token attends to the whole "
                 "row), not a causal LM hybridtrain trains with next-token losses")

FAMILY = Family(
    model_type="gemma3_text",
    embed="model.embed_tokens",
    blocks="model.layers",
    final_norm="model.norm",
    rotary_embed="model.rotary_emb",
    head="lm_head",
    hf_config_class="Gemma3TextConfig",
    embed_scale=True,
    final_logit_softcap="final_logit_softcapping",
    refused_config={"use_bidirectional_attention": BIDIRECTIONAL},
    dropout_keys=("attention_dropout",),
)
