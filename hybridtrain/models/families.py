"""Per-family adapters: where the HF modules live and how a decoder block is split for TP.

Everything here is data (module paths, HF config key names, the tensor-parallel plan keyed by
HF submodule names inside one decoder block), so it is unit-tested without processes and
imports neither torch nor deepspeed.
"""
from __future__ import annotations

from dataclasses import dataclass, field
from typing import Dict, Optional, Tuple


@dataclass(frozen=True)
class TPRule:
    """How one HF linear inside a block is split over the TP group."""

    style: str
    """``column`` (output features split) or ``row`` (input features split, output all-reduced)."""
    conv1d: bool = False
    """HF ``Conv1D`` stores its weight as ``[in, out]`` (GPT-2); it is transposed to ``[out, in]``."""
    fused: int = 1
    """Equal sub-blocks fused along the output dimension (GPT-2 ``c_attn`` = q|k|v: 3); each
    sub-block is split separately so every rank gets matching q, k and v heads."""


@dataclass(frozen=True)
class Family:
    """Adapter for one HF ``model_type``."""

    model_type: str
    embed: str
    """Path of the token embedding in the HF causal-LM model."""
    blocks: str
    """Path of the ``nn.ModuleList`` of decoder blocks."""
    final_norm: str
    head: str
    """Path of the LM head (``lm_head``); tied heads reuse the embedding weight."""
    position_embed: Optional[str] = None
    """Learned absolute position embedding (GPT-2 ``wpe``), or ``None`` (rotary models)."""
    rotary_embed: Optional[str] = None
    """Path of the model's rotary-embedding module; each block rebuilds one of its class."""
    tp_plan: Dict[str, TPRule] = field(default_factory=dict)
    """Block-relative HF module name -> split rule. An entry that matches no module is an error."""
    input_copy: Tuple[str, ...] = ()
    """Block submodules whose first input feeds column-parallel linears: the Megatron "f"
    (identity forward, all-reduce backward) is applied once there instead of once per linear."""
    heads_per_rank_attrs: Tuple[str, ...] = ()
    """``(attention module, attribute)`` pairs divided by tp after sharding, as ``"attn.split_size"``."""
    n_layers: str = "num_hidden_layers"
    hidden: str = "hidden_size"
    heads: str = "num_attention_heads"
    kv_heads: Optional[str] = "num_key_value_heads"
    mlp_width: str = "intermediate_size"
    max_positions: str = "max_position_embeddings"


GPT2 = Family(
    model_type="gpt2",
    embed="transformer.wte",
    position_embed="transformer.wpe",
    blocks="transformer.h",
    final_norm="transformer.ln_f",
    head="lm_head",
    tp_plan={
        "attn.c_attn": TPRule("column", conv1d=True, fused=3),
        "attn.c_proj": TPRule("row", conv1d=True),
        "mlp.c_fc": TPRule("column", conv1d=True),
        "mlp.c_proj": TPRule("row", conv1d=True),
    },
    input_copy=("attn", "mlp"),
    heads_per_rank_attrs=("attn.split_size", "attn.num_heads"),
    n_layers="n_layer",
    hidden="n_embd",
    heads="n_head",
    kv_heads=None,
    mlp_width="n_inner",  # None in HF means 4 * n_embd; see mlp_width_of()
    max_positions="n_positions",
)

LLAMA = Family(
    model_type="llama",
    embed="model.embed_tokens",
    blocks="model.layers",
    final_norm="model.norm",
    rotary_embed="model.rotary_emb",
    head="lm_head",
    tp_plan={
        "self_attn.q_proj": TPRule("column"),
        "self_attn.k_proj": TPRule("column"),
        "self_attn.v_proj": TPRule("column"),
        "self_attn.o_proj": TPRule("row"),
        "mlp.gate_proj": TPRule("column"),
        "mlp.up_proj": TPRule("column"),
        "mlp.down_proj": TPRule("row"),
    },
    input_copy=("self_attn", "mlp"),
)

FAMILIES: Dict[str, Family] = {f.model_type: f for f in (GPT2, LLAMA)}
"""Supported HF ``model_type`` values."""


def get_family(model_type: str) -> Family:
    """The adapter for ``model_type``; raises ``KeyError`` naming the supported families."""
    try:
        return FAMILIES[model_type]
    except KeyError:
        raise KeyError(f"model.model_type={model_type!r} is not supported; "
                       f"use one of {sorted(FAMILIES)}") from None


def mlp_width_of(family: Family, hf_config) -> int:
    """MLP hidden width of ``hf_config`` (GPT-2's ``n_inner=None`` means ``4 * n_embd``)."""
    width = getattr(hf_config, family.mlp_width, None)
    return int(width) if width is not None else 4 * int(getattr(hf_config, family.hidden))


def padded_vocab(vocab_size: int, tp: int, multiple: int = 1) -> int:
    """Vocabulary rounded up to a multiple of ``multiple * tp`` (rows added to embedding and head)."""
    m = multiple * tp
    return -(-vocab_size // m) * m
