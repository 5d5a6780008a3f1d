"""Qwen3.5 (``Qwen3_5ForCausalLM``, ``model_type`` ``qwen3_5_text``): a hybrid of Gated DeltaNet linear attention
and gated full attention, three linear blocks to one full block (``config.layer_types``).

**Full-attention blocks** (variant ``full_attention``): Qwen3's attention (per-head q/k RMSNorm, explicit
``head_dim``, partial rotary) whose ``q_proj`` also outputs a sigmoid gate on the attention output. transformers
lays ``q_proj``'s rows out per head, ``[query_h | gate_h]`` for head ``h`` (``view(..., -1, 2 * head_dim)`` then
``chunk(2)``), so a contiguous split of its rows gives each rank whole heads with their gates: column-parallel as it
stands, ``k_proj``/``v_proj`` column, ``o_proj`` row, the q/k norms ``grad_sum`` (transformers' plan).

**Gated DeltaNet blocks** (variant ``linear_attention``, ``linear_attn``: transformers' ``Qwen3_5GatedDeltaNet``),
split by heads: rank ``r`` keeps key heads ``[r Hk / tp, (r + 1) Hk / tp)`` and value heads
``[r Hv / tp, (r + 1) Hv / tp)``, which are exactly the value heads its key heads serve (transformers repeats each
key head over ``Hv / Hk`` consecutive value heads). So:

* ``in_proj_qkv`` (q | k | v fused, ``Hk dk``, ``Hk dk``, ``Hv dv`` rows) column-parallel block by block;
  ``in_proj_z`` (``Hv dv``), ``in_proj_b`` and ``in_proj_a`` (``Hv`` each) column-parallel;
* ``conv1d``, the depthwise causal conv over the concatenated q | k | v channels: its filters split the same way
  (the ``channels`` style), no collective;
* ``A_log`` and ``dt_bias`` (one per value head, parameters of ``linear_attn`` itself): split by heads (``heads``);
* ``norm``, the gated RMSNorm over one value head's ``dv`` (one weight of ``dv`` shared by all heads): replicated,
  its gradient summed over the TP group (``grad_sum``), as Qwen3's q/k norms;
* ``out_proj`` row-parallel; the forward's ``key_dim`` / ``value_dim`` (the q | k | v split sizes) are divided by
  tp; every reshape views heads as ``-1``.

transformers' own plan gathers every linear-attention output (``colwise_gather_output``); these rules replace it.
The blocks take no mask (the recurrence is causal by construction) and keep packed documents apart by running the
mixer per document (:mod:`hybridtrain.models.linear_attention`). Under context parallelism the full-attention blocks
gather keys and values as every family's do, and each Gated DeltaNet block passes its recurrent state and conv
window from cp rank to cp rank in sequence order (:mod:`hybridtrain.parallel.state_pass`). LoRA adapts the Gated DeltaNet
projections as peft's ``all-linear`` does (``in_proj_qkv`` split block by block like its weight).
"""
from hybridtrain.models.families.base import Family, LinearAttention, TPRule

FULL_ATTENTION = ("self_attn.q_proj", "self_attn.k_proj", "self_attn.v_proj", "self_attn.o_proj", "self_attn.q_norm",
                  "self_attn.k_norm")
"""transformers' plan entries of the full-attention blocks (a linear-attention block has none of them)."""

GATED_DELTANET_RULES: dict = {
    "linear_attn": TPRule("heads"),  # its own A_log [Hv] and dt_bias [Hv]
    "linear_attn.in_proj_qkv": TPRule("column", fused=("linear_k", "linear_k", "linear_v")),
    "linear_attn.in_proj_z": TPRule("column"),
    "linear_attn.in_proj_b": TPRule("column"),
    "linear_attn.in_proj_a": TPRule("column"),
    "linear_attn.conv1d": TPRule("channels", fused=("linear_k", "linear_k", "linear_v")),
    "linear_attn.norm": TPRule("grad_sum"),
    "linear_attn.out_proj": TPRule("row"),
}
"""A Gated DeltaNet module split by heads (the module docstring), shared with Qwen3.5-MoE."""

LINEAR_ATTENTION_RULES = {**GATED_DELTANET_RULES, **{name: None for name in FULL_ATTENTION}}
"""The rules of a linear-attention block over the family's (full-attention) plan."""

GATED_DELTANET_PER_RANK = ("linear_attn.key_dim", "linear_attn.value_dim", "linear_attn.num_k_heads",
                           "linear_attn.num_v_heads", "linear_attn.conv_dim")
"""``linear_attn``'s sizes divided by tp (its forward splits q | k | v by ``key_dim`` and ``value_dim``)."""

UNVERIFIED_LORA = ("adapters on its Gated DeltaNet projections are not yet proven equal to peft's; Qwen3.5's dense "
                   "model (qwen3_5_text) is")
"""Why the MoE hybrids (Qwen3.5-MoE, Qwen3-Next) refuse LoRA on ``linear_attn``."""

FAMILY = Family(
    model_type="qwen3_5_text",
    embed="model.embed_tokens",
    blocks="model.layers",
    final_norm="model.norm",
    rotary_embed="model.rotary_emb",
    head="lm_head",
    hf_config_class="Qwen3_5TextConfig",
    tp_rules={name: None for name in GATED_DELTANET_RULES},  # transformers' gathering entries; the variant's below
    variant_rules={"linear_attention": LINEAR_ATTENTION_RULES},
    variant_input_copy={"linear_attention": ("linear_attn", "mlp")},
    variant_heads_per_rank_attrs={"linear_attention": GATED_DELTANET_PER_RANK},
    linear_attention=LinearAttention(),
    tp_divides=("linear_num_key_heads", "linear_num_value_heads"),
    attn_implementations=("sdpa", "eager"),
    dropout_keys=("attention_dropout",),
)
