"""Gemma 2 (``Gemma2ForCausalLM``): Gemma's scaled embedding, plus the final logit soft-cap
``tanh(logits / c) * c`` in the causal-LM head, attention-score soft-capping, alternating sliding-window
and full layers (``config.layer_types``), and norms before and after attention and MLP.

Attention soft-capping exists only in Gemma 2's own eager kernel: transformers refuses sdpa for it.
"""
from hybridtrain.models.families.base import Family

FAMILY = Family(
    model_type="gemma2",
    embed="model.embed_tokens",
    blocks="model.layers",
    final_norm="model.norm",
    rotary_embed="model.rotary_emb",
    head="lm_head",
    hf_config_class="Gemma2Config",
    embed_scale=True,
    final_logit_softcap="final_logit_softcapping",
    attn_implementations=("eager",),
    dropout_keys=("attention_dropout",),
)
