"""Qwen3 (``Qwen3ForCausalLM``): Qwen2 with a per-head RMSNorm on q and k and an explicit ``head_dim``.

The q/k norms normalise each head over ``head_dim``: a rank holding whole heads computes them right
as they are (replicated), but their weight gradient then covers this rank's heads only and is summed
over the TP group (transformers' plan: ``replicated_with_grad_allreduce``, here ``grad_sum``).
"""
from hybridtrain.models.families.base import Family

FAMILY = Family(
    model_type="qwen3",
    embed="model.embed_tokens",
    blocks="model.layers",
    final_norm="model.norm",
    rotary_embed="model.rotary_emb",
    head="lm_head",
    hf_config_class="Qwen3Config",
    dropout_keys=("attention_dropout",),
)
