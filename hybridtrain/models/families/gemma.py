"""Gemma (``GemmaForCausalLM``): the embedding lookup is scaled by sqrt(hidden) (inside HF's
``GemmaTextScaledWordEmbedding``; the tied head uses the raw weight), (1 + w) RMSNorm, GeGLU MLP, an
explicit ``head_dim``, tied embeddings by default."""
from hybridtrain.models.families.base import Family

FAMILY = Family(
    model_type="gemma",
    embed="model.embed_tokens",
    blocks="model.layers",
    final_norm="model.norm",
    rotary_embed="model.rotary_emb",
    head="lm_head",
    hf_config_class="GemmaConfig",
    embed_scale=True,
    dropout_keys=("attention_dropout",),
)
