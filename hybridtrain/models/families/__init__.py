"""The supported model families, registered in one place.

Each family is one module of this package holding its :class:`~hybridtrain.models.families.base.Family`
(module paths, the tensor-parallel plan derived from transformers' own, model-level operations).
Adding a family: a module here, one line in :data:`FAMILIES`, a ``conf/model/<family>.yaml`` and a tiny
config in the family tests (``docs/families.md``).
"""
from __future__ import annotations

from hybridtrain.models.families import (deepseek_v3, gemma, gemma2, gemma3, gpt2, gpt_neox, gpt_oss, llama, mistral,
                                         mixtral, olmo2, olmo3, olmoe, phi3, qwen2, qwen2_moe, qwen3, qwen3_5,
                                         qwen3_5_moe, qwen3_moe, qwen3_next, smollm3)
from hybridtrain.models.families.base import (  # noqa: F401  (the package's API)
    Family,
    MoE,
    TPRule,
    fused_sizes,
    head_dim_of,
    kv_heads_of,
    mlp_width_of,
    padded_vocab,
    tp_divisible,
)

GPT2 = gpt2.FAMILY
LLAMA = llama.FAMILY

FAMILIES: dict[str, Family] = {f.model_type: f for f in (
    gpt2.FAMILY, llama.FAMILY, mistral.FAMILY, qwen2.FAMILY, qwen3.FAMILY, gemma.FAMILY, gemma2.FAMILY, phi3.FAMILY,
    olmo2.FAMILY, gpt_neox.FAMILY, qwen3_moe.FAMILY, mixtral.FAMILY, olmoe.FAMILY, qwen2_moe.FAMILY, gpt_oss.FAMILY,
    deepseek_v3.FAMILY, qwen3_5.FAMILY, qwen3_5_moe.FAMILY, qwen3_next.FAMILY, smollm3.FAMILY, olmo3.FAMILY,
    gemma3.FAMILY)}
"""Supported HF ``model_type`` values, each verified exact against transformers (``docs/families.md``)."""


def get_family(model_type: str) -> Family:
    """The adapter for ``model_type``; raises ``KeyError`` naming the supported families."""
    try:
        return FAMILIES[model_type]
    except KeyError:
        raise KeyError(f"model.model_type={model_type!r} is not supported; "
                       f"use one of {sorted(FAMILIES)}") from None


def family_of(model) -> Family:
    """The family of a ``model`` config section (:class:`~hybridtrain.config.schema.ModelConfig`): the
    verified one of ``model.model_type``, or with ``model.family=auto`` the adapter derived from
    transformers' plans (:mod:`hybridtrain.models.families.auto`, checked by the plan on a tiny twin)."""
    if str(getattr(model, "family", None) or "") == "auto":
        from hybridtrain.models.families.auto import derive

        return derive(model.model_type)
    return get_family(model.model_type)
