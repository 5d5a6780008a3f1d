"""Resolve and validate a run's plan before anything launches (no deepspeed import here)."""
from __future__ import annotations

from hybridtrain.config.schema import Config
from hybridtrain.plan.validate import Machine, Plan, PlanError, build_plan, check_hf_overrides, layer_names

__all__ = ["Machine", "Plan", "PlanError", "build_plan", "machine_facts", "model_config", "resolve", "layer_params"]


def machine_facts() -> Machine:
    """What this node offers: CUDA GPUs, fp16 support, CPU cores."""
    import os

    import torch

    gpus = torch.cuda.device_count() if torch.cuda.is_available() else 0
    if gpus:
        fp16 = True
    else:  # DeepSpeed's CPU accelerator allows fp16 only with mkldnn fp16 kernels
        fp16 = bool(getattr(torch.ops.mkldnn, "_is_mkldnn_fp16_supported", lambda: False)())
    return Machine(gpus_per_node=gpus, fp16_supported=fp16, cpu_cores=os.cpu_count() or 1)


def layer_params(cfg: Config, hf_config) -> list[int]:
    """Parameter count of each pipeline layer (from the meta model; no memory is allocated)."""
    from hybridtrain.models.build import meta_model
    from hybridtrain.models.families import get_family

    family = get_family(cfg.model.model_type)
    model = meta_model(hf_config)

    def count(path: str) -> int:
        return sum(p.numel() for p in model.get_submodule(path).parameters())

    counts = [count(family.embed)] + ([count(family.position_embed)] if family.position_embed else [])
    counts += [count(f"{family.blocks}.{i}") for i in range(getattr(hf_config, family.n_layers))]
    counts += [count(family.final_norm), count(family.embed if hf_config.tie_word_embeddings else family.head)]
    return counts


def model_config(cfg: Config):
    """The HF config of this run: ``model.config`` overrides over the family defaults, with the
    tokenizer's vocabulary size and EOS id unless overridden. Launcher and workers both call this."""
    from hybridtrain.data.tokenizer import eos_id, vocab_size
    from hybridtrain.models.build import hf_config_of
    from hybridtrain.models.families import FAMILIES

    if cfg.model.model_type not in FAMILIES:
        raise PlanError("model.model_type", f"{cfg.model.model_type!r} is not supported; use one of {sorted(FAMILIES)}")
    check_hf_overrides(cfg.model.model_type, cfg.model.config)
    try:
        vocab, eos = vocab_size(cfg.data), eos_id(cfg.data)
    except FileNotFoundError as err:
        raise PlanError("data.tokenizer", str(err)) from None
    return hf_config_of(cfg.model.model_type, dict(cfg.model.config), vocab, cfg.model.attn_implementation, eos)


def resolve(cfg: Config, machine: Machine | None = None) -> tuple[Plan, object]:
    """Validate ``cfg`` on this machine; return the :class:`Plan` and the HF model config."""
    from hybridtrain.data.tokenizer import vocab_size

    hf_config = model_config(cfg)
    params = layer_params(cfg, hf_config) if cfg.parallel.partition == "parameters" else None
    plan = build_plan(cfg, hf_config, machine or machine_facts(), vocab_size(cfg.data), params)
    return plan, hf_config
