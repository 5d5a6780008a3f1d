"""Resolve and validate a run's plan before anything launches (no deepspeed import here)."""
from __future__ import annotations

from hybridtrain.config.schema import Config
from hybridtrain.errors import PlanError
from hybridtrain.plan.types import Machine, Plan
from hybridtrain.plan.hf import (apply_pretrained_defaults, check_pretrained_weights, layer_params, model_config,
                                 pretrained_config)
from hybridtrain.plan.machine import machine_facts
from hybridtrain.plan.devices import memory_budget, planned_machine, precision_for
from hybridtrain.plan.validate import apply_world_size, build_plan, vocab_pad_multiple

__all__ = ["Machine", "Plan", "PlanError", "apply_pretrained_defaults", "build_plan", "choose_checkpointing",
           "machine_facts", "model_config", "pretrained_config", "resolve", "layer_params", "rank_budget"]


def resolve(cfg: Config, machine: Machine | None = None, announce=None) -> tuple[Plan, object]:
    """Validate ``cfg`` on this machine; return the :class:`Plan` and the HF model config.

    With ``parallel.auto`` the layout is searched first (:mod:`hybridtrain.plan.auto`) and written
    into ``cfg.parallel``; ``announce`` (e.g. ``print``) receives the explanation.
    ``plan.world_size`` stands for the devices: it sets ``launcher.gpus_per_node`` when that is
    unset, else ``launcher.nodes``.
    """
    from hybridtrain.data.tokenizer import vocab_size

    here = machine or machine_facts()
    machine = planned_machine(cfg.launcher, here)  # a cluster plans for its nodes
    hf_config = model_config(cfg)
    if cfg.model.pretrained:  # the weights' headers, before any data is tokenized or rank started
        check_pretrained_weights(cfg, hf_config)
    cfg.model.vocab_pad_multiple = vocab_pad_multiple(cfg, machine)  # null: 64 on GPUs, 1 on CPU
    cfg.trainer.precision = precision_for(cfg.trainer.precision, cfg.launcher, machine)  # null: bf16 on GPUs
    if str(cfg.model.family or "") == "auto":
        check_derived_family(cfg, hf_config, announce)
    apply_world_size(cfg)
    params = layer_params(cfg, hf_config) if cfg.parallel.partition == "parameters" else None
    vocab = vocab_size(cfg.data)
    if cfg.parallel.auto:
        from hybridtrain.plan.auto import apply, search

        choice = search(cfg, hf_config, machine, vocab_size=vocab, layer_params=params)
        apply(cfg, choice.best)
        if announce is not None:
            announce(choice.explain(cfg.plan.top))
        params = layer_params(cfg, hf_config) if cfg.parallel.partition == "parameters" else None
    plan = build_plan(cfg, hf_config, machine, vocab, params)
    if cfg.parallel.activation_checkpointing is None:  # null: the plan decides from the rank's memory
        on, why = choose_checkpointing(cfg, hf_config, plan, rank_budget(cfg, plan, here))
        cfg.parallel.activation_checkpointing = on  # resolved, as config.yaml records it
        if on:  # the balanced partition's memory constraint changes with it
            plan = build_plan(cfg, hf_config, machine, vocab, params)
        if announce is not None:
            announce(f"[hybridtrain] activation checkpointing {why}")
    if cfg.finetune.method != "full" or cfg.finetune.lora.init_from:
        from hybridtrain.plan.lora import check_lora

        check_lora(cfg, hf_config, plan)
    return plan, hf_config


def rank_budget(cfg: Config, plan: Plan, machine: Machine) -> int:
    """Bytes one rank of ``plan`` may hold (0: unknown): the device memory of the planned devices less the
    GPU headroom (:func:`~hybridtrain.plan.devices.memory_budget`); ``machine``: this machine's facts."""
    planned = planned_machine(cfg.launcher, machine)
    return memory_budget(cfg.plan, cfg.launcher, planned, max(1, plan.world_size // plan.nodes))


def choose_checkpointing(cfg: Config, hf_config, plan: Plan, budget: int) -> tuple[bool, str]:
    """``parallel.activation_checkpointing: null``: whether to recompute the blocks' activations, and why.

    On only where the fullest rank of ``plan`` (the memory model of :func:`hybridtrain.plan.report.build_report`,
    activations kept) exceeds ``budget`` bytes (:func:`rank_budget`); off where it fits, or where the device
    memory is unknown (0). The reason states the numbers, e.g. ``off (parallel.activation_checkpointing: null):
    the fullest rank holds 34.89 GiB with the activations kept, within its 69.64 GiB budget``."""
    from hybridtrain.plan.memory import GiB
    from hybridtrain.plan.report import build_report

    def fullest(checkpointing: bool) -> int:
        cfg.parallel.activation_checkpointing = checkpointing
        try:
            return max(st.memory.total for st in build_report(cfg, plan, hf_config, budget).stages)
        finally:
            cfg.parallel.activation_checkpointing = None

    key = "(parallel.activation_checkpointing: null)"
    kept = fullest(False)
    if not budget:
        return False, (f"off {key}: the device memory is unknown, so the plan keeps the activations ({kept / GiB:.2f} "
                       "GiB on the fullest rank); set plan.device_memory_gb (or launcher.gpu_type) to let it check")
    if kept <= budget:
        return False, (f"off {key}: the fullest rank holds {kept / GiB:.2f} GiB with the activations kept, within "
                       f"its {budget / GiB:.2f} GiB budget")
    return True, (f"on {key}: the fullest rank would hold {kept / GiB:.2f} GiB with the activations kept, over its "
                  f"{budget / GiB:.2f} GiB budget; recomputing each block's activations it holds "
                  f"{fullest(True) / GiB:.2f} GiB (about a third more compute)")


def check_derived_family(cfg: Config, hf_config, announce=None) -> None:
    """``model.family=auto``: run the self-check (:mod:`hybridtrain.models.selfcheck`) and refuse the
    model with the measured difference when hybridtrain and transformers disagree."""
    from hybridtrain.models.families import family_of
    from hybridtrain.models.selfcheck import TOLERANCE, AdapterFailed, TwinFailed, self_check

    try:
        diffs = self_check(family_of(cfg.model), hf_config)
    except TwinFailed as err:
        raise PlanError("model.config", f"{err}; check the model.config overrides (e.g. head_dim against "
                        "hidden_size / num_attention_heads)") from None
    except AdapterFailed as err:
        raise PlanError("model.family", f"auto: the adapter derived for {cfg.model.model_type!r} from transformers' "
                        f"plans cannot run this model: {err}; it needs a verified family (docs/families.md)") from None
    measured = ", ".join(f"tp={tp}: {d:.2e}" for tp, d in diffs.items())
    if max(diffs.values()) > TOLERANCE:
        raise PlanError("model.family", f"auto: the adapter derived for {cfg.model.model_type!r} from transformers' plans "
                        f"does not reproduce transformers on a tiny twin of this config (max |logit difference| / "
                        f"max |logit| = {measured}; tolerance {TOLERANCE:g}): the model does something outside its "
                        "decoder blocks that the plans do not describe; it needs a verified family (docs/families.md)")
    if announce is not None:
        announce(f"[hybridtrain] model.family=auto: the adapter derived for {cfg.model.model_type} matches transformers "
                 f"on a tiny twin ({measured})")
