"""Mistral (``MistralForCausalLM``): Llama with sliding-window attention on every layer.

The window (``sliding_window``, on by default) reaches the blocks through their masks: each block
builds transformers' sliding-window causal mask (:class:`~hybridtrain.models.stages.DecoderBlock`).
"""
from hybridtrain.models.families.base import Family

FAMILY = Family(
    model_type="mistral",
    embed="model.embed_tokens",
    blocks="model.layers",
    final_norm="model.norm",
    rotary_embed="model.rotary_emb",
    head="lm_head",
    hf_config_class="MistralConfig",
    dropout_keys=("attention_dropout",),
)
