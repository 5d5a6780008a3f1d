"""What ``python -m hybridtrain.plan`` prints: rank map, stages, memory per rank, bubble, warnings.

A pure function of the typed config, the resolved :class:`~hybridtrain.plan.validate.Plan`, the HF
config and the memory budget of a rank (:func:`hybridtrain.plan.rank_budget`: the device's memory, less
the GPU headroom); no process group, no weights (a meta model).
"""
from __future__ import annotations

from dataclasses import dataclass, field
from typing import Optional

from hybridtrain.config.schema import Config
from hybridtrain.models.families import family_of
from hybridtrain.models.units import Kind, block_index, kind_of
from hybridtrain.plan.costs import (
    ModelFacts,
    has_score_head,
    layer_time_costs,
    model_facts,
    stage_flops,
    stage_params,
)
from hybridtrain.plan.lora import lora_memory
from hybridtrain.plan.memory import GiB, RankMemory, memory_flags, rank_memory
from hybridtrain.plan.moe import ExpertFacts, expert_facts
from hybridtrain.plan.partition import partition_advice
from hybridtrain.parallel.dims import AXES
from hybridtrain.plan.types import Plan

IMBALANCE_WARN = 0.10
"""Warn when the slowest stage's estimated time exceeds the mean by more than this."""
MAX_RANK_ROWS = 64
"""Rank-map rows printed before the rest is summarised."""


@dataclass
class StageReport:
    """One pipeline stage as the plan command shows it."""

    stage: int
    layers: list[str]
    params: int
    """Parameters on one TP rank of the stage."""
    flops_per_token: float
    """Model training FLOPs per token of the stage (all TP ranks)."""
    time_cost: float
    """Estimated forward + backward FLOP-equivalents of one micro-batch on one rank."""
    memory: RankMemory


@dataclass
class PlanReport:
    """Everything the plan command prints, as data (tests read it)."""

    plan: Plan
    facts: ModelFacts
    stages: list[StageReport]
    device_memory: int
    bubble: float
    imbalance: float
    """Slowest stage time over the mean, minus 1."""
    warnings: list[str] = field(default_factory=list)
    ranks_per_node: int = 0
    """Devices per node (``launcher.gpus_per_node``); 0: the ranks spread evenly over the nodes."""
    experts: Optional[ExpertFacts] = None
    """A mixture-of-experts model's routed experts (:mod:`hybridtrain.plan.moe`), ``None`` for a dense one."""

    def rank_map(self) -> list[dict[str, int]]:
        """Every rank's node and coordinates on every axis (:data:`~hybridtrain.parallel.dims.AXES`, ``tp`` fastest)."""
        p = self.plan
        per_node = self.ranks_per_node or max(1, p.world_size // p.nodes)
        return [{"rank": r, "node": r // per_node, **c.__dict__} for r, c in enumerate(p.dims.all_coords())]


def build_report(cfg: Config, plan: Plan, hf_config, device_memory: int) -> PlanReport:
    """Estimate stages and memory of ``plan``; collect the warnings."""
    facts = model_facts(family_of(cfg.model), hf_config, plan.seq_len, plan.dims.tp, cfg.model.vocab_pad_multiple,
                        score_head=has_score_head(cfg))
    costs = layer_time_costs(facts, plan.micro_batch_size, plan.dims)
    stages = []
    lora = lora_memory(cfg, hf_config, plan)  # LoRA: only the adapters train
    for s in range(plan.dims.pp):
        a, b = plan.stage_bounds[s], plan.stage_bounds[s + 1]
        mem = rank_memory(facts, plan.stage_bounds, s, plan.dims, zero=plan.zero_stage,
                          precision=plan.precision, micro_batch=plan.micro_batch_size,
                          micro_batches=plan.grad_accum, checkpointing=cfg.parallel.activation_checkpointing,
                          lora=lora, **memory_flags(cfg, facts, plan.gpus))
        stages.append(StageReport(s, facts.names[a:b], stage_params(facts, plan.stage_bounds, s, plan.dims.tp,
                                                                plan.dims.ep),
                                  stage_flops(facts, plan.stage_bounds, s), sum(costs[a:b]), mem))
    times = [st.time_cost for st in stages]
    imbalance = max(times) / (sum(times) / len(times)) - 1 if plan.dims.pp > 1 else 0.0
    bubble = plan.bubble
    report = PlanReport(plan, facts, stages, device_memory, bubble, imbalance,
                        ranks_per_node=cfg.launcher.gpus_per_node or 0,
                        experts=expert_facts(facts.family, hf_config, plan.dims, facts.total_params()))
    if imbalance > IMBALANCE_WARN:
        slow = max(stages, key=lambda st: st.time_cost).stage
        how = partition_advice(plan.partition_method, plan.stage_bounds, measured=False)
        report.warnings.append(f"stage imbalance {imbalance:.0%}: stage {slow} is the slowest; {how}")
    for st in stages:
        if device_memory and st.memory.total > device_memory:
            report.warnings.append(
                f"stage {st.stage}: {st.memory.total / GiB:.2f} GiB per rank exceeds the budget of "
                f"{device_memory / GiB:.2f} GiB (plan.device_memory_gb or the device's memory; on GPUs less "
                "plan.memory_headroom and plan.memory_reserved_gb); raise tp/pp/dp with ZeRO, turn on "
                "parallel.activation_checkpointing, lower parallel.micro_batch_size, or split long sequences with "
                "parallel.cp (docs/long-context.md)")
    if "ep" in plan.dims.crossing(plan.nodes):
        report.warnings.append(f"expert groups cross nodes: every MoE layer's all-to-all over parallel.ep="
                               f"{plan.dims.ep} goes over the network; use an ep whose groups fit one node's "
                               f"{plan.world_size // plan.nodes} ranks (a group spans ep x cp x tp consecutive ranks; "
                               "docs/moe.md)")
    if plan.dims.pp > 1 and bubble > 0.25:
        report.warnings.append(f"pipeline bubble {bubble:.0%}: raise the micro-batches per step "
                               f"(trainer.global_batch_size / (micro x dp) = {plan.grad_accum})")
    return report


def _layers(names: list[str]) -> str:
    """``embed, block.0-7, final_norm``: runs of blocks compressed."""
    out, run = [], []
    for n in names + [""]:
        if n and kind_of(n) is Kind.BLOCK:
            run.append(block_index(n))
            continue
        if run:
            out.append(f"block.{run[0]}" + (f"-{run[-1]}" if len(run) > 1 else ""))
            run = []
        if n:
            out.append(n)
    return ", ".join(out)


def _experts_lines(e: Optional[ExpertFacts]) -> list[str]:
    """The plan command's lines on a mixture-of-experts model's routed experts (none for a dense model)."""
    if e is None:
        return []
    return [f"experts   {e.num_experts} routed experts in each of {e.moe_blocks} MoE blocks, top-{e.top_k}, width "
            f"{e.width}; per rank {e.per_rank_experts} experts x width {e.per_rank_width}; active parameters per "
            f"token {e.active_params / 1e6:,.2f}M of {e.total_params / 1e6:,.2f}M"]


def _gib(n: float) -> str:
    return f"{n / GiB:8.3f}"


def format_report(report: PlanReport) -> str:
    """The plan command's text."""
    p, f = report.plan, report.facts
    shown = p.dims.shown_axes()
    lines = [f"model     {f.family.model_type}: {f.total_params() / 1e6:,.1f}M parameters, {p.num_layers} blocks, "
             f"hidden {f.hidden}, vocab {p.vocab_size} (padded to {p.padded_vocab_size})",
             f"plan      {p.dims.product()} = {p.world_size} rank(s) on {p.nodes} node(s), "
             f"ZeRO-{p.zero_stage}, {p.precision}",
             f"batch     global {p.global_batch_size} = micro {p.micro_batch_size} x accumulation {p.grad_accum} "
             f"x dp {p.dims.dp}; tokens per step {p.tokens_per_step:,} ({p.global_batch_size} x {p.seq_len})",
             f"pipeline  bubble (pp-1)/(m+pp-1) = ({p.dims.pp}-1)/({p.grad_accum}+{p.dims.pp}-1) = {report.bubble:.1%}"
             + (f"; stage imbalance {report.imbalance:.1%} (slowest stage over the mean)" if p.dims.pp > 1 else ""),
             *_experts_lines(report.experts), "", "rank map (DeepSpeed topology: tp fastest, then cp, then dp, then pp)",
             f"  {'rank':>5} {'node':>5} " + " ".join(f"{axis:>4}" for axis in shown)]
    ranks = report.rank_map()
    for r in ranks[:MAX_RANK_ROWS]:
        lines.append(f"  {r['rank']:>5} {r['node']:>5} " + " ".join(f"{r[axis]:>4}" for axis in shown))
    if len(ranks) > MAX_RANK_ROWS:
        strides = " + ".join(f"{axis} x {p.dims.stride(axis)}" if p.dims.stride(axis) > 1 else axis
                             for axis in AXES if axis in shown)
        lines.append(f"  ... {len(ranks) - MAX_RANK_ROWS} more: rank = {strides}, "
                     f"node = rank // {report.ranks_per_node or p.world_size // p.nodes}")
    total_flops = sum(st.flops_per_token for st in report.stages) or 1.0
    lines += ["", "stages (params per TP rank; model FLOPs per token, forward + backward, all TP ranks)",
              f"  {'stage':>5} {'params':>14} {'GFLOP/token':>12} {'share':>6} {'est.time':>8}  layers"]
    mean_time = sum(st.time_cost for st in report.stages) / len(report.stages)
    for st in report.stages:
        lines.append(f"  {st.stage:>5} {st.params:>14,} {st.flops_per_token / 1e9:>12.3f} "
                     f"{st.flops_per_token / total_flops:>6.1%} {st.time_cost / mean_time:>8.2f}  {_layers(st.layers)}")
    budget = f" of a {report.device_memory / GiB:.2f} GiB budget" if report.device_memory else ""
    lines += ["", f"memory per rank in GiB{budget} (ZeRO-{p.zero_stage}, {p.precision}, micro-batch "
              f"{p.micro_batch_size} x seq {p.seq_len}, activations x in-flight micro-batches)",
              f"  {'stage':>5} {'params':>8} {'grads':>8} {'optim':>8} {'activ.':>8} {'reduce':>8} {'total':>8}  in-flight"]
    for st in report.stages:
        m = st.memory
        flight = min(p.dims.pp - st.stage, p.grad_accum)
        lines.append(f"  {st.stage:>5} {_gib(m.params)} {_gib(m.grads)} {_gib(m.optim)} {_gib(m.activations)} "
                     f"{_gib(m.reduce)} {_gib(m.total)}  {max(1, flight)}")
    lines.append("")
    lines += [f"warning   {w}" for w in report.warnings] or ["warnings  none"]
    return "\n".join("[hybridtrain] " + ln if ln else "" for ln in lines)
