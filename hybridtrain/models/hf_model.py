"""The HF side of a model, before any parallelism: its config, the whole model on the meta device, and
the plain single-process model hybridtrain's workers start from.

The whole HF model is created on the meta device (shapes, no memory); :mod:`hybridtrain.models.build`
materialises one unit of it at a time. :func:`reference_model` is the unsharded twin the tests and
``verify`` compare against: the same seeded initialisation (:func:`~hybridtrain.models.seeded_init.init_unit`)
with every tile filled.
"""
from __future__ import annotations

from typing import Any, Dict

import torch
import torch.nn as nn

from hybridtrain.models.families import Family
from hybridtrain.models.seeded_init import init_unit
from hybridtrain.models.units import Kind, model_units


def hf_config_of(model_type: str, overrides: Dict[str, Any], vocab_size: int,
                 attn_implementation: str, eos_token_id: int | None = None):
    """The HF ``PretrainedConfig`` for ``model_type`` with ``overrides`` applied.

    ``vocab_size`` and the BOS/EOS ids (the tokenizer's) are used unless the overrides set them; the
    family's default pad id is dropped (it names a token of the family's own tokenizer, e.g. Phi-3's
    32000, not of this one) unless ``pad_token_id`` is overridden.
    """
    from transformers import AutoConfig

    special = {"pad_token_id": None}
    if eos_token_id is not None:
        special.update(bos_token_id=eos_token_id, eos_token_id=eos_token_id)
    kwargs = {"vocab_size": vocab_size, **special, **overrides}
    cfg = AutoConfig.for_model(model_type, **kwargs)
    cfg._attn_implementation = attn_implementation
    cfg.use_cache = False
    return cfg


def meta_model(hf_config) -> nn.Module:
    """The full HF causal LM on the meta device (parameters have shapes, no storage)."""
    from transformers import AutoModelForCausalLM

    with torch.device("meta"):
        return AutoModelForCausalLM.from_config(hf_config, attn_implementation=hf_config._attn_implementation)


def reference_model(hf_config, family: Family, seed: int) -> nn.Module:
    """A plain, unsharded HF model with exactly the weights hybridtrain's workers start from."""
    from transformers import AutoModelForCausalLM

    model = AutoModelForCausalLM.from_config(hf_config, attn_implementation=hf_config._attn_implementation)
    for name in unit_names(family, hf_config):
        init_unit(model, name, seed)
    return model


def unit_names(family: Family, hf_config) -> list[str]:
    """The HF units hybridtrain initialises separately, in pipeline order (a tied head has no
    weight of its own)."""
    return [u.hf_path for u in model_units(family, hf_config) if not (u.kind is Kind.HEAD and u.tied)]


def linear_in_out(module: nn.Module, conv1d: bool) -> tuple[int, int]:
    """``(in, out)`` features of an HF linear layer (``Conv1D`` stores its weight ``[in, out]``)."""
    rows, cols = module.weight.shape
    return (int(rows), int(cols)) if conv1d else (int(cols), int(rows))
