"""The plan: every cross-key rule, checked before any process is launched.

:func:`build_plan` is a pure function of the typed config, the HF model config and a few
machine facts (:class:`Machine`), so each rule is unit-tested without processes. Every
violation raises :class:`PlanError` naming the key path, the values and a fix.
"""
from __future__ import annotations

import re
from typing import Callable, Optional

from hybridtrain.config.schema import Config
from hybridtrain.errors import PlanError
from hybridtrain.models.families import padded_vocab, tp_divisible
from hybridtrain.parallel.dims import ParallelDims, data_parallel_degree
from hybridtrain.models.units import model_units, split_around_blocks
from hybridtrain.models.units import names as unit_names
from hybridtrain.plan.context import check_context_parallel, check_recurrent_context_parallel
from hybridtrain.plan.data import check_data_config, check_packing_kernel
from hybridtrain.plan.objective import check_objective
from hybridtrain.plan.reward import check_reward
from hybridtrain.plan.devices import is_cluster, planned_machine, precision_for, uses_gpus
from hybridtrain.plan.hf import checked_family
from hybridtrain.plan.memory import balanced_inputs
from hybridtrain.plan.moe import (check_expert_parallel, check_expert_stages, check_grouped_mm_alignment, check_moe,
                                  check_moe_precision, expert_stage_needs)
from hybridtrain.plan.partition import MANUAL, manual, partition, stage_problem
from hybridtrain.plan.types import Machine, Plan


def zero_stage_for(asked: int | None, dp: int, precision: str) -> int:
    """The ZeRO stage a run uses: ``parallel.zero_stage`` when set, else 0 for fp32 with dp = 1
    and 1 otherwise.

    With one replica ZeRO has nothing to partition, and in fp32 stage 1 only adds DeepSpeed's flat
    fp32 master copy and gradient buffers (half again the model state, and about 10% of a small
    model's step time on a CPU). In bf16/fp16 that master copy is needed anyway, and stage 0 would
    switch to DeepSpeed's separate bf16 optimizer, which fails with tp > 1 (see :func:`resolve`)."""
    if asked is not None:
        return asked
    return 0 if dp == 1 and precision == "fp32" else 1


GPU_VOCAB_PAD_MULTIPLE = 64
"""``model.vocab_pad_multiple: null`` on GPUs: vocabulary rows a multiple of 64 x tp keep the
embedding and LM-head matmuls on tensor-core friendly shapes."""


def vocab_pad_multiple(cfg: Config, machine: Machine) -> int:
    """``model.vocab_pad_multiple``, or for ``null`` 64 on GPUs and 1 on CPU processes."""
    if cfg.model.vocab_pad_multiple is not None:
        return cfg.model.vocab_pad_multiple
    return GPU_VOCAB_PAD_MULTIPLE if uses_gpus(cfg.launcher, machine) else 1


def apply_world_size(cfg: Config) -> None:
    """``plan.world_size`` stands for the devices: it sets ``launcher.gpus_per_node`` when that is unset,
    else ``launcher.nodes`` (whole nodes of ``launcher.gpus_per_node``)."""
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


def _need(ok: bool, key: str, message: str) -> None:
    if not ok:
        raise PlanError(key, message)


SLURM_SIZE = re.compile(r"^[0-9]+[KMGT]?$")
"""A memory size as ``sbatch`` takes it (``64G``, ``512000M``; no unit: megabytes)."""


def _check_cluster_launcher(lau) -> None:
    """Rules of the ``slurm`` and ``multinode`` launcher keys (docs/slurm.md)."""
    if is_cluster(lau):
        _need(lau.gpu_type is None or lau.gpus is not False, "launcher.gpu_type",
              f"launcher.gpu_type={lau.gpu_type} names the nodes' GPUs but launcher.gpus=false asks for none; "
              "drop one of them")
    if lau.name == "slurm":
        _need(lau.signal_seconds >= 0, "launcher.signal_seconds", f"must be >= 0 (0: no warning), got {lau.signal_seconds}")
        _need(not lau.wait or lau.submit, "launcher.wait", "launcher.wait=true needs launcher.submit=true (nothing "
              "to wait for); drop one of them")
        _need(lau.cpus_per_task is None or lau.cpus_per_task >= 1, "launcher.cpus_per_task",
              f"must be >= 1 or null, got {lau.cpus_per_task}")
        _need(lau.mem_per_gpu is None or bool(SLURM_SIZE.match(str(lau.mem_per_gpu))), "launcher.mem_per_gpu",
              f"{lau.mem_per_gpu!r} is not a SLURM memory size; use e.g. 64G or 512000M, or put another "
              "--mem option in launcher.sbatch")
    if lau.name == "multinode":
        _need(lau.no_ssh or lau.hostfile is not None, "launcher.hostfile",
              "launcher=multinode needs a DeepSpeed hostfile (launcher.hostfile=hosts.txt, reached over ssh) or "
              "launcher.no_ssh=true with launcher.node_rank and launcher.master_addr on every node")
        if lau.no_ssh:
            _need(lau.node_rank is not None and 0 <= lau.node_rank < lau.nodes, "launcher.node_rank",
                  f"launcher.no_ssh=true needs this node's index in [0, launcher.nodes={lau.nodes}), got {lau.node_rank}")
            _need(bool(lau.master_addr), "launcher.master_addr",
                  "launcher.no_ssh=true needs the address of node 0 (launcher.master_addr=HOST), the same on every node")


def build_plan(cfg: Config, hf_config, machine: Machine, vocab_size: int,
               layer_params: Optional[list[int]] = None, facts_for_tp: Optional[Callable] = None) -> Plan:
    """Check every rule and return the resolved :class:`Plan`; raise :class:`PlanError` on the first violation.

    ``machine`` is this machine's facts (a cluster launcher plans for its nodes instead,
    :func:`~hybridtrain.plan.devices.planned_machine`); ``facts_for_tp(tp)``, when given, returns the
    model's :func:`~hybridtrain.plan.costs.model_facts` (``parallel=auto`` validates many layouts of one model)."""
    par, tr, lau = cfg.parallel, cfg.trainer, cfg.launcher
    machine = planned_machine(lau, machine)  # a cluster's nodes, not this machine (plan/devices.py)
    family = checked_family(cfg)
    _need(cfg.model.attn_implementation in family.attn_implementations, "model.attn_implementation",
          f"{cfg.model.attn_implementation!r}: transformers runs {family.model_type} only with "
          f"{list(family.attn_implementations)}; use model.attn_implementation={family.attn_implementations[0]}")
    for key, why in family.refused_config.items():
        _need(not getattr(hf_config, key, None), f"model.config.{key}",
              f"{key}={getattr(hf_config, key, None)!r}: {why}; set model.config.{key}=false")
    pad_multiple = vocab_pad_multiple(cfg, machine)
    _need(pad_multiple >= 1, "model.vocab_pad_multiple", f"must be >= 1 or null, got {pad_multiple}")
    cfg.model.vocab_pad_multiple = pad_multiple  # null resolved for this machine, as config.yaml records it
    check_data_config(cfg.data, tr)
    check_objective(cfg)  # finetune.objective against data.format, finetune.dpo
    check_reward(cfg, family, hf_config)  # finetune.objective=reward: its data, method and family
    check_moe(cfg, family, hf_config)  # parallel.ep and what mixture-of-experts models cannot do yet
    check_packing_kernel(cfg.data, cfg.model.attn_implementation)
    tr.precision = precision_for(tr.precision, lau, machine)  # null resolved: bf16 on GPUs, fp32 on CPUs
    check_moe_precision(cfg, family, hf_config)
    _need(0 <= cfg.plan.memory_headroom < 1, "plan.memory_headroom",
          f"must be in [0, 1) (the share of a GPU's memory kept free), got {cfg.plan.memory_headroom}")
    _need(cfg.plan.memory_reserved_gb >= 0, "plan.memory_reserved_gb", f"must be >= 0, got {cfg.plan.memory_reserved_gb}")
    _need(cfg.plan.device_memory_gb is None or cfg.plan.device_memory_gb > 0, "plan.device_memory_gb",
          f"must be > 0 (GiB of one device), got {cfg.plan.device_memory_gb}; leave it null to use the GPU's (or the "
          "machine's) own")

    for key in ("tp", "pp", "micro_batch_size"):
        _need(getattr(par, key) >= 1, f"parallel.{key}", f"must be >= 1, got {getattr(par, key)}")
    _need(par.dp is None or par.dp >= 1, "parallel.dp", f"must be >= 1 or null (fill the devices), got {par.dp}")
    _need(tr.global_batch_size >= 1, "trainer.global_batch_size", f"must be >= 1, got {tr.global_batch_size}")
    _need(lau.nodes >= 1, "launcher.nodes", f"must be >= 1, got {lau.nodes}")
    _need(lau.gpus_per_node is None or lau.gpus_per_node >= 1, "launcher.gpus_per_node", f"must be >= 1 or null, got {lau.gpus_per_node}")
    _need(lau.threads_per_rank is None or lau.threads_per_rank >= 1, "launcher.threads_per_rank",
          f"must be >= 1 or null (cores / local ranks), got {lau.threads_per_rank}")
    _need(lau.timeout_minutes >= 1, "launcher.timeout_minutes", f"must be >= 1, got {lau.timeout_minutes}")
    _need(tr.hang_timeout_s is None or tr.hang_timeout_s > 0, "trainer.hang_timeout_s",
          f"must be > 0 seconds or null (watchdog off), got {tr.hang_timeout_s}")
    _need(lau.master_port is None or 1024 <= lau.master_port <= 65535, "launcher.master_port",
          f"must be in [1024, 65535] or null (pick a free port), got {lau.master_port}")

    _check_cluster_launcher(lau)
    check_grouped_mm_alignment(cfg, family, hf_config, par.tp, uses_gpus(lau, machine))

    # World size against the devices. A cluster launcher's nodes are not this machine: only
    # launcher.gpus_per_node counts there.
    here = (machine.gpus_per_node or None) if lau.name == "local" else None
    per_node = lau.gpus_per_node if lau.gpus_per_node is not None else here
    cp = check_context_parallel(cfg, family, hf_config)
    dp = data_parallel_degree(par.dp, par.tp, par.pp, per_node, lau.nodes, cp)
    ep = check_expert_parallel(cfg, family, hf_config, dp, zero_stage_for(par.zero_stage, dp * cp, tr.precision))
    dims = ParallelDims(pp=par.pp, dp=dp, cp=cp, tp=par.tp, ep=ep)  # the one place a run's degrees are put together
    model_ranks = dims.world // dp  # cp x tp x pp ranks hold one replica's rows
    world = dims.world
    if lau.name != "local" and per_node is not None:  # srun / the runner start one rank per device
        _need(world == per_node * lau.nodes, "launcher.gpus_per_node",
              f"{dims.formula()} = {world} ranks but launcher.nodes={lau.nodes} x "
              f"launcher.gpus_per_node={per_node} = {per_node * lau.nodes} devices; {lau.name} starts one rank per "
              f"device: use launcher.gpus_per_node={world // lau.nodes if world % lau.nodes == 0 else '?'} or "
              f"parallel.dp={per_node * lau.nodes // model_ranks}")

    # Topology: a TP group all-reduces twice per block forward and backward; across nodes that
    # traffic would leave NVLink for the network (placement: world / nodes consecutive ranks a node).
    if lau.nodes > 1 and world % lau.nodes == 0 and "tp" in dims.crossing(lau.nodes):
        ranks = world // lau.nodes
        fits = [d for d in range(1, ranks + 1) if ranks % d == 0]
        if per_node is None or ranks == per_node:  # every device holds a rank
            where, fix = (f"launcher.gpus_per_node={per_node if per_node is not None else ranks}",
                          f"launcher.gpus_per_node a multiple of {par.tp}")
        else:  # an explicit parallel.dp leaves devices idle: the ranks spread evenly, fewer per node
            total = per_node * lau.nodes
            where = (f"{dims.formula()} = {world} ranks on launcher.nodes={lau.nodes}, "
                     f"though launcher.gpus_per_node={per_node} gives {total} devices")
            fix = (f"parallel.dp={total // model_ranks} (or null: fill the devices) for {per_node} ranks per node"
                   if total % model_ranks == 0 else f"launcher.gpus_per_node a multiple of {par.tp}")
        raise PlanError("parallel.tp", f"parallel.tp={par.tp} does not divide the {ranks} ranks per node ({where}): "
                        f"tensor-parallel groups would span nodes and every block's all-reduces would cross the "
                        f"network; use tp in {fits}, or {fix}")

    # Batch arithmetic: global = micro x accumulation x dp.
    unit = par.micro_batch_size * dp
    _need(tr.global_batch_size % unit == 0, "trainer.global_batch_size",
          f"{tr.global_batch_size} is not divisible by parallel.micro_batch_size x dp = "
          f"{par.micro_batch_size} x {dp} = {unit}; use a multiple of {unit} "
          f"(e.g. {max(unit, tr.global_batch_size // unit * unit)}) or change micro_batch_size/dp")
    grad_accum = tr.global_batch_size // unit

    # Model shape against tp and pp.
    num_layers = int(getattr(hf_config, family.n_layers))
    sizes = tp_divisible(family, hf_config)  # heads, KV heads, MLP width (fused blocks follow from them)
    valid = [d for d in range(1, 65) if all(v % d == 0 for v in sizes.values())]
    for key, value in sizes.items():
        _need(value % par.tp == 0, "parallel.tp",
              f"parallel.tp={par.tp} must divide model.config.{key}={value}; use tp in {valid}")
    _need(num_layers >= par.pp, "parallel.pp",
          f"parallel.pp={par.pp} exceeds the model's {num_layers} layers (model.config.{family.n_layers}); "
          f"use pp <= {num_layers}")
    max_pos = getattr(hf_config, family.max_positions, None)
    _need(cfg.data.seq_len >= 1 and (max_pos is None or cfg.data.seq_len <= max_pos), "data.seq_len",
          f"{cfg.data.seq_len} must be in [1, model.config.{family.max_positions}={max_pos}]")
    model_vocab = int(hf_config.vocab_size)
    if cfg.model.pretrained:  # the weights fix the embedding: the config key cannot (probe n35)
        _need(vocab_size <= model_vocab, "data.tokenizer",
              f"the tokenizer has {vocab_size} tokens but the embedding of {cfg.model.pretrained} only {model_vocab} "
              "rows: the tokenizer and the weights disagree; point data.tokenizer at the tokenizer the model was "
              "trained with (or leave it unset to use the folder's), or grow the embedding once with transformers "
              "(model.resize_token_embeddings(len(tokenizer)), then save_pretrained) and train that folder")
    _need(vocab_size <= model_vocab, "model.config.vocab_size",
          f"the tokenizer has {vocab_size} tokens but the model only {model_vocab}; "
          f"set model.config.vocab_size >= {vocab_size} or leave it unset")

    # DeepSpeed limits.
    zero = zero_stage_for(par.zero_stage, dims.data, tr.precision)
    _need(0 <= zero <= 3, "parallel.zero_stage", f"must be 0, 1, 2 or 3 (or null), got {zero}")
    _need(par.pp == 1 or zero <= 1, "parallel.zero_stage",
          f"zero_stage={zero} with parallel.pp={par.pp}: DeepSpeed's pipeline engine supports "
          "ZeRO 0 and 1 only; use parallel.zero_stage=1, or pp=1 for ZeRO-2/3")
    check_recurrent_context_parallel(family, cp, zero)
    _need(tr.precision != "fp16" or machine.fp16_supported, "trainer.precision",
          "fp16 is not supported on this device (no GPU / no CPU fp16 kernels); use bf16 or fp32")
    where = f"launcher.gpu_type={machine.gpu_type}" if machine.gpu_type else "this machine's GPU"
    _need(tr.precision != "bf16" or machine.bf16_supported, "trainer.precision",
          f"bf16 needs an Ampere or newer GPU, and {where} has no bf16 (compute capability below 8.0); "
          "use trainer.precision=fp16 or fp32")
    # 16-bit ZeRO-0 is DeepSpeed's unpartitioned fp16/bf16 optimizer (about 20 bytes per parameter on
    # every rank) or, with fp32 gradient accumulation, no optimizer at all (NotImplementedError); its
    # checkpoints lack the fp32 master weights and the AdamW moments hybridtrain saves and re-shards.
    # ZeRO-1 holds the same state at dp = 1 and partitions it at dp > 1.
    _need(zero != 0 or tr.precision == "fp32", "parallel.zero_stage",
          f"zero_stage=0 with trainer.precision={tr.precision}: DeepSpeed trains 16-bit ZeRO-0 with an "
          "unpartitioned optimizer whose checkpoints cannot be saved, resumed or re-sharded; use "
          "parallel.zero_stage=1 (the same memory with one replica) or leave it null")

    # Loop.
    _need(tr.max_steps >= 1, "trainer.max_steps", f"must be >= 1, got {tr.max_steps}")
    _need(tr.log_every >= 1, "trainer.log_every", f"must be >= 1, got {tr.log_every}")
    _need(tr.loss_chunk_tokens >= 1, "trainer.loss_chunk_tokens",
          f"must be >= 1 (tokens per piece of the LM head and loss), got {tr.loss_chunk_tokens}")
    _need(0 <= cfg.optim.warmup_steps <= tr.max_steps, "optim.warmup_steps",
          f"{cfg.optim.warmup_steps} must be in [0, trainer.max_steps={tr.max_steps}]")
    _need(cfg.optim.lr > 0, "optim.lr", f"must be > 0, got {cfg.optim.lr}")
    _need(len(cfg.optim.betas) == 2 and all(0 <= b < 1 for b in cfg.optim.betas), "optim.betas",
          f"must be two numbers in [0, 1), got {list(cfg.optim.betas)}")
    _need(0 <= cfg.optim.min_lr_ratio <= 1, "optim.min_lr_ratio", f"must be in [0, 1], got {cfg.optim.min_lr_ratio}")
    _need(not tr.export_hf or tr.save_final, "trainer.export_hf",
          "the export is made from the final checkpoint; set trainer.save_final=true or trainer.export_hf=false")
    _need(tr.save_every >= 0, "trainer.save_every", f"must be >= 0 (0: final save only), got {tr.save_every}")
    _need(tr.keep_last is None or tr.keep_last >= 1, "trainer.keep_last",
          f"must be >= 1 or null (keep all), got {tr.keep_last}")
    _need(cfg.optim.grad_clip >= 0, "optim.grad_clip", f"must be >= 0 (0 disables), got {cfg.optim.grad_clip}")

    names = unit_names(model_units(family, hf_config))
    n_pre, _, n_post = split_around_blocks(names)
    padded = padded_vocab(model_vocab, par.tp, pad_multiple)
    if par.stage_layers is not None:
        try:
            bounds = manual(par.stage_layers, len(names), par.pp)
        except ValueError as err:
            raise PlanError("parallel.stage_layers", f"{list(par.stage_layers)} {err}; the layers are "
                            f"{names[0]}, ..., {names[-1]} ({len(names)} in all)") from None
    else:
        costs = fits = None
        if par.partition == "balanced" and par.pp > 1:
            costs, fits = balanced_inputs(cfg, hf_config, dims, zero, grad_accum, padded, machine,
                                          facts_for_tp(par.tp) if facts_for_tp else None)
        needs = expert_stage_needs(family, hf_config, dims, zero, names, lora=cfg.finetune.method == "lora")
        bounds = partition(par.partition, n_pre, num_layers, n_post, par.pp, layer_params, costs, fits,
                           block_per_stage=cfg.finetune.method == "lora", needs=needs)
    for s in range(par.pp):
        why = stage_problem(names[bounds[s]:bounds[s + 1]])
        key = "parallel.stage_layers" if par.stage_layers is not None else "parallel.partition"
        _need(why is None, key, f"stage {s}: {why}; " + (
            "change parallel.stage_layers" if par.stage_layers is not None
            else f"use parallel.partition=balanced or blocks instead of {par.partition}"))
    check_expert_stages(family, hf_config, dims, zero, names, bounds,
                        "parallel.stage_layers" if par.stage_layers is not None else "parallel.partition",
                        lora=cfg.finetune.method == "lora")
    return Plan(
        dims=dims, world_size=world, nodes=lau.nodes,
        micro_batch_size=par.micro_batch_size, grad_accum=grad_accum,
        global_batch_size=tr.global_batch_size, zero_stage=zero, precision=tr.precision,
        seq_len=cfg.data.seq_len, tokens_per_step=tr.global_batch_size * cfg.data.seq_len,
        vocab_size=model_vocab, padded_vocab_size=padded,
        num_layers=num_layers, layer_names=names, stage_bounds=bounds,
        partition_method=MANUAL if par.stage_layers is not None else str(par.partition),
        gpus=uses_gpus(lau, machine))
