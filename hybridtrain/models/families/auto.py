"""``model.family=auto``: an adapter derived from transformers' own plans for a ``model_type`` that has no
verified family.

What the plans give: the module paths (``base_model_prefix`` + ``base_model_pp_plan``: the embedding,
the block list, the final norm; the causal-LM class's ``_pp_plan``: the head) and the block's
tensor-parallel split (``base_model_tp_plan``, Megatron-exact styles only). What they do not give, and
what the self-check (:mod:`hybridtrain.models.selfcheck`) must therefore catch: operations in the
model's forward outside the blocks (embedding multipliers, logit scaling or soft-capping in the
head, extra norms), masks the model builds its own way, and config values read at forward time.
Derivation refuses what it can see cannot work (gathering TP styles, modules between the embedding
and the blocks other than a dropout at 0, no block list).
"""
from __future__ import annotations

from functools import lru_cache

from hybridtrain.models.families.base import HF_STYLES, Family


class NotDerivable(ValueError):
    """transformers' plans for a ``model_type`` cannot give a Megatron-exact adapter; the message says why."""


@lru_cache(maxsize=None)
def derive(model_type: str) -> Family:
    """The adapter of ``model_type`` from transformers' plans (see the module docstring); raises
    :class:`NotDerivable`. Cached per ``model_type``: it reads only transformers' classes."""
    import torch
    from transformers import AutoConfig, AutoModelForCausalLM

    config = AutoConfig.for_model(model_type, num_hidden_layers=1)
    tp_plan = dict(getattr(config, "base_model_tp_plan", None) or {})
    pp_plan = dict(getattr(config, "base_model_pp_plan", None) or {})
    if not tp_plan or not pp_plan:
        raise NotDerivable(f"{type(config).__name__} ships no base_model_tp_plan/base_model_pp_plan")
    odd = sorted({f"{k}: {v}" for k, v in tp_plan.items() if ".*." in k and v not in HF_STYLES})
    if odd:
        raise NotDerivable(f"its tensor-parallel plan has styles that are not a Megatron split ({odd})")
    with torch.device("meta"):
        model = AutoModelForCausalLM.from_config(config)
    prefix = model.base_model_prefix
    base = model.get_submodule(prefix)
    keys = list(pp_plan)
    blocks = next((k for k, (inputs, _) in pp_plan.items() if "attention_mask" in inputs), None)
    if blocks is None or not isinstance(base.get_submodule(blocks), torch.nn.ModuleList):
        raise NotDerivable(f"no decoder-block list in base_model_pp_plan {keys}")
    between = keys[1:keys.index(blocks)]
    for name in between:
        module = base.get_submodule(name)
        if not isinstance(module, torch.nn.Dropout) or module.p:
            raise NotDerivable(f"the model runs {name} ({type(module).__name__}) between the embedding and "
                               "the blocks; the generic path supports only a dropout at 0 there")
    after = keys[keys.index(blocks) + 1:]
    if len(after) != 1:
        raise NotDerivable(f"expected one final norm after the blocks in base_model_pp_plan, got {after}")
    head = next(iter(getattr(type(model), "_pp_plan", None) or {"lm_head": None}))
    embedding = base.get_submodule(keys[0])
    if type(embedding) is not torch.nn.Embedding and not hasattr(embedding, "embed_scale"):
        raise NotDerivable(f"its embedding is a {type(embedding).__name__}, not an nn.Embedding")
    block = base.get_submodule(blocks)[0]
    attention = next((n for n, m in block.named_children() if "Attention" in type(m).__name__), None)
    rotary = next((n for n, m in base.named_children() if "RotaryEmbedding" in type(m).__name__), None)
    column = [k.split(".*.", 1)[1] for k, v in tp_plan.items() if ".*." in k and HF_STYLES[v] == "column"]
    return Family(
        model_type=model_type,
        embed=f"{prefix}.{keys[0]}",
        blocks=f"{prefix}.{blocks}",
        final_norm=f"{prefix}.{after[0]}",
        head=head,
        rotary_embed=f"{prefix}.{rotary}" if rotary else None,
        attention=attention or "self_attn",
        hf_config_class=type(config).__name__,
        input_copy=tuple(dict.fromkeys(name.split(".")[0] for name in column)),
        embed_scale=hasattr(embedding, "embed_scale"),
        final_logit_softcap="final_logit_softcapping" if hasattr(config, "final_logit_softcapping") else None,
        # no flash_attention_2: the self-check (models/selfcheck.py) runs on the CPU and could not verify it
        attn_implementations=("sdpa", "eager") if getattr(model, "_supports_sdpa", False) else ("eager",),
        dropout_keys=tuple(k for k in config.to_dict() if "dropout" in k or "pdrop" in k),
        kv_heads="num_key_value_heads" if hasattr(config, "num_key_value_heads") else None,
    )
