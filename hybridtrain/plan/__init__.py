"""Resolve and validate a run's plan before anything launches (no deepspeed import here)."""
from __future__ import annotations

from hybridtrain.config.schema import Config
from hybridtrain.errors import PlanError
from hybridtrain.plan.types import Machine, Plan
from hybridtrain.plan.validate import build_plan, check_hf_overrides

__all__ = ["Machine", "Plan", "PlanError", "apply_pretrained_defaults", "build_plan", "machine_facts", "model_config",
           "pretrained_config", "resolve", "layer_params"]

SHAPE_KEYS = ("vocab_size", "hidden_size", "n_embd", "intermediate_size", "n_inner", "num_hidden_layers", "n_layer",
              "num_attention_heads", "n_head", "num_key_value_heads", "head_dim", "max_position_embeddings",
              "n_positions", "tie_word_embeddings")
"""HF config keys that fix tensor shapes: a ``model.config`` override may not change them for a
pretrained model."""


def machine_facts() -> Machine:
    """What this node offers: CUDA GPUs, fp16 support, CPU cores."""
    import os

    import torch

    gpus = torch.cuda.device_count() if torch.cuda.is_available() else 0
    if gpus:
        fp16 = True
    else:  # DeepSpeed's CPU accelerator allows fp16 only with mkldnn fp16 kernels
        fp16 = bool(getattr(torch.ops.mkldnn, "_is_mkldnn_fp16_supported", lambda: False)())
    if gpus:
        memory = int(torch.cuda.get_device_properties(0).total_memory)
    else:
        try:
            memory = os.sysconf("SC_PAGE_SIZE") * os.sysconf("SC_PHYS_PAGES")
        except (ValueError, OSError, AttributeError):
            memory = 0
    return Machine(gpus_per_node=gpus, fp16_supported=fp16, cpu_cores=os.cpu_count() or 1,
                   device_memory_bytes=int(memory))


def layer_params(cfg: Config, hf_config) -> list[int]:
    """Parameter count of each pipeline layer, unpadded vocabulary, a tied head counted again
    (from the parameter shapes; no model is built)."""
    from hybridtrain.plan.costs import model_facts

    facts = model_facts(cfg.model.model_type, hf_config, cfg.data.seq_len)
    return [u.params(1) for u in facts.units]


def pretrained_config(cfg: Config):
    """The HF config of the ``model.pretrained`` folder, checked: it exists, is an HF model of a
    supported family matching ``model.model_type``, and needs no remote code unless allowed."""
    from pathlib import Path

    from transformers import AutoConfig

    from hybridtrain.models.families import FAMILIES

    folder = Path(cfg.model.pretrained).expanduser()
    if not folder.is_dir():
        raise PlanError("model.pretrained", f"{cfg.model.pretrained!r} does not exist or is not a folder; "
                        "give the folder written by save_pretrained")
    if not (folder / "config.json").is_file():
        raise PlanError("model.pretrained", f"{folder} is not a HuggingFace model folder (no config.json); "
                        "give the folder written by save_pretrained")
    try:
        hf = AutoConfig.from_pretrained(str(folder), trust_remote_code=cfg.model.trust_remote_code)
    except ValueError as err:  # unknown model_type, or remote code refused
        raise PlanError("model.pretrained", f"{folder}: {err}".splitlines()[0] +
                        "; only built-in architectures load unless model.trust_remote_code=true") from None
    if hf.model_type not in FAMILIES:
        raise PlanError("model.pretrained", f"{folder} holds a {hf.model_type!r} model; supported architectures: "
                        f"{sorted(FAMILIES)}")
    if hf.model_type != cfg.model.model_type:
        raise PlanError("model.model_type", f"model.pretrained is a {hf.model_type!r} model but "
                        f"model.model_type={cfg.model.model_type!r}; use model={hf.model_type}")
    for key, value in cfg.model.config.items():  # overrides on top (dropout and the like)
        if key in SHAPE_KEYS and getattr(hf, key, None) != value:
            raise PlanError(f"model.config.{key}", f"{value} differs from the checkpoint's {getattr(hf, key, None)} "
                            f"in {folder}; a pretrained model's shape cannot change: drop the override")
        setattr(hf, key, value)
    hf._attn_implementation = cfg.model.attn_implementation
    hf.use_cache = False
    return hf


def apply_pretrained_defaults(cfg: Config) -> None:
    """With ``model.pretrained`` and no ``data.tokenizer``, use the model folder's tokenizer."""
    from pathlib import Path

    if cfg.model.pretrained and cfg.data.tokenizer is None:
        if (Path(cfg.model.pretrained).expanduser() / "tokenizer.json").is_file():
            cfg.data.tokenizer = str(Path(cfg.model.pretrained).expanduser().resolve())


def model_config(cfg: Config):
    """The HF config of this run: ``model.config`` overrides over the family defaults, with the
    tokenizer's vocabulary size and EOS id unless overridden. Launcher and workers both call this."""
    from hybridtrain.data.tokenizer import load_tokenizer
    from hybridtrain.models.build import hf_config_of
    from hybridtrain.models.families import FAMILIES

    if cfg.model.model_type not in FAMILIES:
        raise PlanError("model.model_type", f"{cfg.model.model_type!r} is not supported; use one of {sorted(FAMILIES)}")
    check_hf_overrides(cfg.model.model_type, cfg.model.config)
    if cfg.model.pretrained:
        return pretrained_config(cfg)
    try:
        tokenizer = load_tokenizer(cfg.data)  # once: both numbers
        vocab, eos = len(tokenizer), tokenizer.eos_token_id
    except FileNotFoundError as err:
        raise PlanError("data.tokenizer", str(err)) from None
    return hf_config_of(cfg.model.model_type, dict(cfg.model.config), vocab, cfg.model.attn_implementation, eos)


def resolve(cfg: Config, machine: Machine | None = None, announce=None) -> tuple[Plan, object]:
    """Validate ``cfg`` on this machine; return the :class:`Plan` and the HF model config.

    With ``parallel.auto`` the layout is searched first (:mod:`hybridtrain.plan.auto`) and written
    into ``cfg.parallel``; ``announce`` (e.g. ``print``) receives the explanation.
    ``plan.world_size`` stands for the devices: it sets ``launcher.gpus_per_node`` when that is
    unset, else ``launcher.nodes``.
    """
    from hybridtrain.data.tokenizer import vocab_size

    machine = machine or machine_facts()
    hf_config = model_config(cfg)
    world, lau = cfg.plan.world_size, cfg.launcher
    if world is not None and lau.gpus_per_node is None:
        if world < 1 or world % lau.nodes:
            raise PlanError("plan.world_size", f"{world} ranks do not spread evenly over launcher.nodes="
                            f"{lau.nodes}; use a positive multiple of {lau.nodes}")
        lau.gpus_per_node = world // lau.nodes
    elif world is not None and world != lau.nodes * lau.gpus_per_node:  # plan for more or fewer nodes
        if world < 1 or world % lau.gpus_per_node:
            raise PlanError("plan.world_size", f"{world} ranks are not whole nodes of launcher.gpus_per_node="
                            f"{lau.gpus_per_node}; use a multiple of {lau.gpus_per_node}")
        lau.nodes = world // lau.gpus_per_node
    if cfg.parallel.auto:
        from hybridtrain.plan.auto import apply, search

        choice = search(cfg, hf_config, machine)
        apply(cfg, choice.best)
        if announce is not None:
            announce(choice.explain(cfg.plan.top))
    params = layer_params(cfg, hf_config) if cfg.parallel.partition == "parameters" else None
    plan = build_plan(cfg, hf_config, machine, vocab_size(cfg.data), params)
    return plan, hf_config
