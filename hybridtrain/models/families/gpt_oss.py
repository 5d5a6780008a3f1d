"""gpt-oss (``GptOssForCausalLM``: gpt-oss-20b, gpt-oss-120b): grouped-query attention with biases on q, k, v
and o and a learned per-head **sink** logit (``self_attn.sinks [heads]``, a softmax column every query sees and
that is then dropped), layers alternating sliding-window and full attention (``config.layer_types``), and a
mixture-of-experts MLP in every block: a router with a bias (``mlp.router``: top-k of the logits, softmax over
the k chosen) and transposed, biased experts with a clamped SwiGLU (``swiglu_alpha``, ``swiglu_limit``) whose
gate and up columns are interleaved (``gate_up_proj [E, H, 2I]``: gate at ``::2``, up at ``1::2``).

transformers ships no tensor-parallel plan for the blocks, so it is written here: q, k, v column-wise and o
row-wise (their biases split alike, o's added after the reduction), the sinks split by heads like q (the
``heads`` style), the experts over their width in the interleaved layout (``experts_interleaved``: rank ``r``
keeps gate and up slice ``r``, one contiguous run of the interleaved columns; the down projection's bias added
once, after the reduction), the router replicated outside the tensor-parallel region. transformers runs the sinks
only in its eager attention (and hub kernels), so ``eager`` is the one kernel here.

Published checkpoints hold the experts in MXFP4 (``*_blocks`` / ``*_scales`` with a ``quantization_config``):
the plan refuses them and names the dequantised ``save_pretrained`` folder to make instead
(:func:`hybridtrain.plan.hf.pretrained_config`).
"""
from __future__ import annotations

from hybridtrain.models.families.base import Family, MoE, TPRule

FAMILY = Family(
    model_type="gpt_oss",
    embed="model.embed_tokens",
    blocks="model.layers",
    final_norm="model.norm",
    rotary_embed="model.rotary_emb",
    head="lm_head",
    tp_rules={
        "self_attn.q_proj": TPRule("column"),
        "self_attn.k_proj": TPRule("column"),
        "self_attn.v_proj": TPRule("column"),
        "self_attn.o_proj": TPRule("row"),
        "self_attn": TPRule("heads"),
        "mlp.experts": TPRule("experts_interleaved"),
    },
    input_copy=("self_attn",),
    moe=MoE(router="mlp.router", num_experts="num_local_experts", width="intermediate_size"),
    mlp_width="intermediate_size",
    attn_implementations=("eager",),
    dropout_keys=("attention_dropout",),
)
