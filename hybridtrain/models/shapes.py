"""Parameter shapes of one decoder block and of the final norm, from the HF config alone.

The planner needs only shapes (parameter counts, which tensors a TP rank splits), and building
even a one-block meta model imports the family's HF modeling code with torch behind it: about
2 s of the launcher's start-up, before any worker runs. So the shapes of the supported families
are written down here, in HF's parameter order; ``tests/unit/test_shapes.py`` checks them against
HF's meta model for each family and its shape options. A config these functions do not cover
returns ``None`` and the caller builds the meta model (:func:`hybridtrain.models.build.meta_model`).

Pure data: imports neither torch nor transformers.
"""
from __future__ import annotations

from typing import Callable, Dict, Optional, Tuple

Shapes = Dict[str, Tuple[int, ...]]
"""HF parameter name relative to its module (``attn.c_attn.weight``) -> shape."""


def _gpt2_block(c) -> Optional[Shapes]:
    if getattr(c, "add_cross_attention", False):  # a cross-attention block has more modules
        return None
    h = int(c.n_embd)
    inner = int(c.n_inner) if getattr(c, "n_inner", None) is not None else 4 * h
    return {  # Conv1D weights are stored [in, out]
        "ln_1.weight": (h,), "ln_1.bias": (h,),
        "attn.c_attn.weight": (h, 3 * h), "attn.c_attn.bias": (3 * h,),
        "attn.c_proj.weight": (h, h), "attn.c_proj.bias": (h,),
        "ln_2.weight": (h,), "ln_2.bias": (h,),
        "mlp.c_fc.weight": (h, inner), "mlp.c_fc.bias": (inner,),
        "mlp.c_proj.weight": (inner, h), "mlp.c_proj.bias": (h,),
    }


def _llama_block(c) -> Optional[Shapes]:
    h, heads = int(c.hidden_size), int(c.num_attention_heads)
    kv = int(getattr(c, "num_key_value_heads", None) or heads)
    head_dim = int(getattr(c, "head_dim", None) or h // heads)
    inner = int(c.intermediate_size)
    out: Shapes = {}

    def linear(name: str, n_in: int, n_out: int, bias: bool) -> None:
        out[f"{name}.weight"] = (n_out, n_in)
        if bias:
            out[f"{name}.bias"] = (n_out,)

    attn_bias, mlp_bias = bool(getattr(c, "attention_bias", False)), bool(getattr(c, "mlp_bias", False))
    linear("self_attn.q_proj", h, heads * head_dim, attn_bias)
    linear("self_attn.k_proj", h, kv * head_dim, attn_bias)
    linear("self_attn.v_proj", h, kv * head_dim, attn_bias)
    linear("self_attn.o_proj", heads * head_dim, h, attn_bias)
    linear("mlp.gate_proj", h, inner, mlp_bias)
    linear("mlp.up_proj", h, inner, mlp_bias)
    linear("mlp.down_proj", inner, h, mlp_bias)
    out["input_layernorm.weight"] = (h,)
    out["post_attention_layernorm.weight"] = (h,)
    return out


BLOCKS: Dict[str, Callable[[object], Optional[Shapes]]] = {"gpt2": _gpt2_block, "llama": _llama_block}
"""``model_type`` -> shapes of one decoder block."""

FINAL_NORMS: Dict[str, Callable[[object], Shapes]] = {
    "gpt2": lambda c: {"weight": (int(c.n_embd),), "bias": (int(c.n_embd),)},  # LayerNorm
    "llama": lambda c: {"weight": (int(c.hidden_size),)},  # RMSNorm
}
"""``model_type`` -> shapes of the final norm."""


def block_shapes(model_type: str, hf_config) -> Optional[Shapes]:
    """Shapes of one decoder block of ``hf_config``, or ``None`` when not written down here."""
    fn = BLOCKS.get(model_type)
    return fn(hf_config) if fn is not None else None


def final_norm_shapes(model_type: str, hf_config) -> Optional[Shapes]:
    """Shapes of the final norm of ``hf_config``, or ``None`` when not written down here."""
    fn = FINAL_NORMS.get(model_type)
    return fn(hf_config) if fn is not None else None
