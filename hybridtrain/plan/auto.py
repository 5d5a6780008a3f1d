"""``parallel=auto``: enumerate the layouts, keep those the plan accepts and that fit, estimate each
one's step time, pick the fastest.

A candidate is (dp, cp, ep, tp, pp, micro-batch size, ZeRO stage, activation checkpointing) with
``dp x cp x tp x pp = plan.world_size`` and ``ep`` dividing dp (MoE models: every ep that divides the experts,
``docs/moe.md``); context parallelism (``cp`` > 1, ``docs/long-context.md``) is searched for every cp the sequence
allows (:func:`search`): the cost model picks it where whole rows do not fit,
or fit only with activation checkpointing.
Every candidate goes through the plan's own rules
(:func:`~hybridtrain.plan.validate.build_plan`: tp dividing the heads, pp up to the blocks, ZeRO 0-1
with pp > 1, no 16-bit ZeRO-0, no TP group across nodes, ...), so auto never picks a layout the plan
then refuses; its stage boundaries are the plan's (the memory-aware balanced partition). Memory comes
from :mod:`hybridtrain.plan.memory` (DeepSpeed's layout for the precision and ZeRO stage), against the
budget of :func:`~hybridtrain.plan.devices.memory_budget` (with the GPU headroom). The step time comes
from a cost model on :class:`~hybridtrain.plan.calibrate.Rates` (measured on this machine, or for a
cluster's GPUs derived from ``launcher.gpu_type``):

* compute: each stage's forward + backward FLOP-equivalents of the rank's ``seq / cp`` tokens
  (:mod:`hybridtrain.plan.costs`,
  plus one more forward of the blocks under activation checkpointing) at the matmul rate
  (a matmul of the model's width), plus the fixed overhead per layer call, both slowed by
  ``ranks x threads / cores`` when a node's ranks oversubscribe its CPU cores;
* tensor parallelism: 2 all-reduces of ``[b, s, h]`` per block forward and 2 backward, 1 for the
  vocabulary-parallel embedding and 4 for the head and loss, at the node's latency and bandwidth
  (probed with as many processes as the node's ranks);
* pipeline: a send of ``[b, s, h]`` forward and one backward per micro-batch and boundary;
  1F1B takes ``(m + pp - 1)`` slots of the slowest stage (the bubble);
* context parallelism: per block an all-gather of the whole row's keys and values forward
  (``2 x b x s x kv_heads x head_dim`` elements, ``(cp - 1) / cp`` of them over the link) and the
  reduce-scatter of their gradients backward;
* expert parallelism (``ep`` > 1, MoE models; ``ep`` dividing dp and the experts): per MoE block the dropless
  dispatch and combine all-to-alls forward and backward, each of the rank's tokens x top-k x hidden
  (``(ep - 1) / ep`` of it over the link); the experts' gradients reduce over the ``dp / ep`` ranks holding the
  same experts, and each rank holds ``E / ep`` experts (:mod:`hybridtrain.plan.memory`);
* data parallelism (over the data axis ``dp x cp``): the ring all-reduce of the stage's gradients once
  per step, plus the all-gather of the updated partitions (ZeRO-1/2: 1.5x) and of the parameters in forward and
  backward (ZeRO-3: 2.5x), and the AdamW update of the rank's share.

A data-parallel, context-parallel or pipeline group that spans nodes communicates at the inter-node rate
(:meth:`~hybridtrain.plan.calibrate.Rates.link`); TP groups never do (the plan refuses them).
"""
from __future__ import annotations

from dataclasses import dataclass, field, replace

from hybridtrain.config.schema import Config
from hybridtrain.errors import PlanError
from hybridtrain.models.units import Kind
from hybridtrain.plan.calibrate import Rates, planned_rates
from hybridtrain.plan.costs import ELEMENTWISE_COST, ModelFacts, has_score_head, layer_time_costs, model_facts
from hybridtrain.plan.devices import memory_budget, planned_machine, precision_for, uses_gpus
from hybridtrain.plan.memory import memory_flags, rank_memory, stage_param_sizes
from hybridtrain.plan.types import Machine, Plan
from hybridtrain.plan.validate import apply_world_size, build_plan, vocab_pad_multiple

DP_VOLUME = {0: 1.0, 1: 1.5, 2: 1.5, 3: 2.5}
"""Data-parallel traffic per step in all-reduces of the gradients: ZeRO-1/2 add the all-gather of
the updated parameter partitions (half an all-reduce), ZeRO-3 also gathers the parameters in the
forward and the backward."""
OPTIMIZER_COST = 4.0
"""Element-wise passes of an AdamW update per parameter (moments, master, weight), times
:data:`~hybridtrain.plan.costs.ELEMENTWISE_COST`."""


@dataclass(frozen=True)
class Candidate:
    """One layout and what the cost model says about it."""

    dp: int
    tp: int
    pp: int
    micro_batch_size: int
    zero_stage: int
    activation_checkpointing: bool
    cp: int = 1
    """Context-parallel ranks splitting each row (after the others so that positional construction keeps
    its order)."""
    ep: int = 1
    """Expert-parallel ranks (carved from dp) splitting each MoE layer's experts."""
    step_time: float = 0.0
    """Estimated seconds per optimizer step."""
    memory: int = 0
    """Estimated bytes of the fullest rank."""
    parts: dict = field(default_factory=dict, compare=False)
    """Seconds per step by cause: compute, tp_comm, cp_comm (cp > 1), bubble, dp_comm, optimizer."""
    bounds: tuple = ()

    def label(self) -> str:
        cp = f"cp={self.cp} " if self.cp > 1 else ""
        ep = f"ep={self.ep} " if self.ep > 1 else ""
        return (f"dp={self.dp} {cp}{ep}tp={self.tp} pp={self.pp} micro={self.micro_batch_size} "
                f"ZeRO-{self.zero_stage} ckpt={'on' if self.activation_checkpointing else 'off'}")

    def config(self, cfg: Config) -> Config:
        """``cfg`` with this layout in ``parallel`` (a shallow copy: the other sections are shared)."""
        return replace(cfg, parallel=replace(cfg.parallel, dp=self.dp, cp=self.cp, ep=self.ep, tp=self.tp, pp=self.pp,
                                             auto=False,
                                             micro_batch_size=self.micro_batch_size, zero_stage=self.zero_stage,
                                             activation_checkpointing=self.activation_checkpointing))


def _divisors(n: int) -> list[int]:
    return [d for d in range(1, n + 1) if n % d == 0]


def _allreduce(nbytes: float, n: int, link: tuple[float, float]) -> float:
    latency, bandwidth = link
    return 0.0 if n <= 1 else latency + 2 * (n - 1) / n * nbytes / bandwidth


def _alltoall(nbytes: float, n: int, link: tuple[float, float]) -> float:
    """An all-to-all of ``nbytes`` per rank spread evenly: each rank sends ``(n-1)/n`` of it (the dropless
    dispatch's splits follow the router; even is the balanced case)."""
    latency, bandwidth = link
    return 0.0 if n <= 1 else latency + (n - 1) / n * nbytes / bandwidth


def _allgather(nbytes: float, n: int, link: tuple[float, float]) -> float:
    """A ring all-gather (or reduce-scatter) whose result is ``nbytes``: each rank receives ``(n-1)/n`` of it."""
    latency, bandwidth = link
    return 0.0 if n <= 1 else latency + (n - 1) / n * nbytes / bandwidth


def estimate(c: Candidate, plan: Plan, facts: ModelFacts, cfg: Config, rates: Rates, ranks_per_node: int,
             cores: int, kv_width: int = 0, top_k: int = 0) -> Candidate:
    """``c`` with its step time, memory, stage bounds and time breakdown filled in, for its validated
    ``plan`` (whose stage bounds it uses) on ``cfg.launcher.nodes`` nodes of ``ranks_per_node`` ranks
    (``cores`` per node; 0: unknown, no oversubscription). ``kv_width``: KV heads x head width (the all-gather of
    context parallelism); ``top_k``: experts per token of an MoE model (expert parallelism's all-to-alls)."""
    dims = plan.dims  # the candidate's degrees, as the plan built from it holds them
    s, h = facts.seq_len, facts.hidden
    w = 4 if plan.precision == "fp32" else 2
    m = plan.grad_accum
    tokens = c.micro_batch_size * s // dims.cp  # this rank's tokens of a micro-batch (costs.py divides alike)
    costs = layer_time_costs(facts, c.micro_batch_size, dims)
    if c.activation_checkpointing:  # one more forward of every block (1/3 of its training FLOPs)
        costs = [x + (u.flops * tokens / dims.tp / 3 if u.kind is Kind.BLOCK else 0.0)
                 for x, u in zip(costs, facts.units)]
    bounds = list(plan.stage_bounds)
    crossing = dims.crossing(plan.nodes)
    node_link, pp_link = rates.link(False), rates.link("pp" in crossing)
    dp_link = rates.link("dp" in crossing or "cp" in crossing)  # the gradients reduce over the data axis dp x cp
    cp_link = rates.link("cp" in crossing)
    kv = 2 * c.micro_batch_size * s * kv_width * w  # the whole row's keys and values, [2, b, s, kv_heads x head_dim]
    cores = cores or ranks_per_node * rates.threads
    slow = 1.0 if rates.device != "cpu" else max(1.0, ranks_per_node * rates.threads / cores)
    rate = rates.flops / slow
    act = tokens * h * w
    ep_link = rates.link("ep" in crossing)  # the ep groups, carved from dp, may stay on a node where dp crosses
    routed = tokens * top_k * h * w  # a rank's tokens, once per expert they go to: the dispatch's volume
    per_stage, tp_comm, cp_comm, ep_comm = [], 0.0, 0.0, 0.0
    for st in range(dims.pp):
        units = facts.units[bounds[st]:bounds[st + 1]]
        compute = sum(costs[bounds[st]:bounds[st + 1]]) / rate + len(units) * rates.layer_overhead * slow
        blocks = sum(u.kind is Kind.BLOCK for u in units)
        comm = 4 * blocks * _allreduce(act, dims.tp, node_link)
        gather = 2 * blocks * _allgather(kv / dims.tp, dims.cp, cp_link)  # forward all-gather, backward reduce-scatter
        moe_blocks = sum(bool(u.experts) for u in units)  # dispatch and combine, forward and backward
        dispatch = 4 * moe_blocks * _alltoall(routed, dims.ep, ep_link)
        # vocabulary parallel: the embedding's output, the head's input gradient, the loss's max,
        # sum of exponentials and target logit
        comm += (any(u.kind is Kind.EMBED for u in units) + 4 * any(u.kind is Kind.HEAD for u in units)) * (
            _allreduce(act, dims.tp, node_link))
        send = 2 * (pp_link[0] + act / pp_link[1]) if dims.pp > 1 else 0.0
        per_stage.append(compute + comm + gather + dispatch + send)
        tp_comm, cp_comm, ep_comm = max(tp_comm, comm), max(cp_comm, gather), max(ep_comm, dispatch)
    slowest = max(per_stage)
    pipeline = (m + dims.pp - 1) * slowest
    worst_mem, dp_comm, optim = 0, 0.0, 0.0
    for st in range(dims.pp):
        units = facts.units[bounds[st]:bounds[st + 1]]
        dense = sum(stage_param_sizes(units, dims.tp))
        experts = sum(n for u in units for n in u.expert_sizes(dims.tp, dims.ep))
        if dims.ep == 1:
            reduce = _allreduce((dense + experts) * w, dims.data, dp_link)
        else:  # the experts' gradients reduce over the dp / ep ranks holding the same experts
            reduce = _allreduce(dense * w, dims.data, dp_link) + _allreduce(experts * w, dims.data // dims.ep, dp_link)
        dp_comm = max(dp_comm, DP_VOLUME[c.zero_stage] * reduce)
        share = dense + experts if c.zero_stage == 0 else dense / dims.data + experts / (dims.data // dims.ep)
        optim = max(optim, OPTIMIZER_COST * ELEMENTWISE_COST * share / rate)
        # memory.py's formulas at cp > 1 too: the rank's seq / cp tokens, the gathered keys and values, the mask
        mem = rank_memory(facts, bounds, st, dims, zero=plan.zero_stage, precision=plan.precision,
                          micro_batch=c.micro_batch_size, micro_batches=m, checkpointing=c.activation_checkpointing,
                          **memory_flags(cfg, facts, plan.gpus))
        worst_mem = max(worst_mem, mem.total)
    total = pipeline + dp_comm + optim
    parts = {"compute+comm per micro-batch (slowest stage)": slowest, "micro-batches": m,
             "bubble": (dims.pp - 1) * slowest, "tp_comm per micro-batch": tp_comm,
             **({"cp_comm per micro-batch": cp_comm} if dims.cp > 1 else {}),
             **({"ep_comm per micro-batch": ep_comm} if dims.ep > 1 else {}), "dp_comm": dp_comm,
             "optimizer": optim}
    return replace(c, step_time=total, memory=worst_mem, parts=parts, bounds=tuple(bounds))


def context_degrees(seq_len: int, world: int) -> list[int]:
    """The cp degrees a row of ``seq_len`` tokens allows on ``world`` ranks: divisors of the world with
    ``seq_len`` a multiple of ``2 x cp`` (two chunks per rank, :mod:`hybridtrain.plan.context`)."""
    return [cp for cp in _divisors(world) if cp == 1 or seq_len % (2 * cp) == 0]


def expert_degrees(family, hf_config, world: int) -> list[int]:
    """The ep degrees to try on ``world`` ranks: divisors of the world that divide the experts of each MoE layer
    (``[1]`` for a dense model; whether ep divides dp is the plan's rule, :func:`candidates` keeps only those)."""
    if family.moe is None:
        return [1]
    experts = int(getattr(hf_config, family.moe.num_experts))
    return [ep for ep in _divisors(world) if experts % ep == 0]


def candidates(cfg: Config, world: int, cps: tuple[int, ...] | list[int] = (1,),
               eps: tuple[int, ...] | list[int] = (1,)) -> list[Candidate]:
    """Every layout of ``world`` ranks to try for each cp of ``cps`` and ep of ``eps`` (ep dividing dp): dp x cp x
    tp x pp = world, micro-batch
    sizes dividing the batch of a replica, ZeRO 0-3, activation checkpointing off and on. Which of them the
    plan accepts is :func:`~hybridtrain.plan.validate.build_plan`'s to say (:func:`search`); only ZeRO-2/3
    with one replica (dp x cp = 1) are left out (ZeRO-1 with more work)."""
    out = []
    G = cfg.trainer.global_batch_size
    for cp in cps:
        for tp in _divisors(world // cp):
            for pp in _divisors(world // (cp * tp)):
                dp = world // (cp * tp * pp)
                if G % dp:
                    continue
                for ep in (e for e in eps if dp % e == 0):
                    for micro in _divisors(G // dp):
                        for zero in (0, 1, 2, 3):
                            if dp * cp == 1 and zero > 1:
                                continue
                            for ckpt in (False, True):
                                out.append(Candidate(dp, tp, pp, micro, zero, ckpt, cp=cp, ep=ep))
    return out


@dataclass
class Choice:
    """The result of the search: the chosen layout, the runners-up, and the counts."""

    best: Candidate
    ranked: list[Candidate]
    considered: int
    over_memory: int
    device_memory: int
    rates: Rates
    refused: int = 0
    """Layouts the plan's rules refuse (tp not dividing the heads, 16-bit ZeRO-0, ...)."""

    def explain(self, top: int = 5) -> str:
        """Why this plan: its estimated time and memory, what the time is made of, the runners-up."""
        b = self.best
        gib = 2**30
        budget = f"{self.device_memory / gib:.2f} GiB per rank" if self.device_memory else "an unknown memory (no limit)"
        lines = [f"auto      {self.considered} layouts considered, {self.refused} refused by the plan's rules, "
                 f"{self.over_memory} over {budget}; cost model at {self.rates.flops / 1e9:.1f} "
                 f"GFLOP/s per rank, all-reduce {self.rates.latency * 1e6:.0f} us + "
                 f"{self.rates.bandwidth / 1e9:.2f} GB/s ({'measured' if self.rates.measured_link else 'built-in'} "
                 f"{self.rates.device} rates)",
                 f"auto      chose {b.label()}: {b.step_time * 1e3:.1f} ms/step, {b.memory / gib:.3f} GiB on the "
                 f"fullest rank; " + ", ".join(f"{k} {v * 1e3:.1f} ms" if k != "micro-batches" else f"{k} {v}"
                                                for k, v in b.parts.items())]
        for i, c in enumerate(self.ranked[1:top + 1], 2):
            lines.append(f"auto      #{i} {c.label()}: {c.step_time * 1e3:.1f} ms/step "
                         f"({c.step_time / b.step_time:.2f}x), {c.memory / gib:.3f} GiB")
        return "\n".join("[hybridtrain] " + ln for ln in lines)


def world_size(cfg: Config, machine: Machine) -> int:
    """``plan.world_size``, else ``launcher.nodes x launcher.gpus_per_node`` (or this node's GPUs)."""
    if cfg.plan.world_size is not None:
        return cfg.plan.world_size
    per_node = cfg.launcher.gpus_per_node or machine.gpus_per_node or 1
    return cfg.launcher.nodes * per_node


def search(cfg: Config, hf_config, machine: Machine, rates: Rates | None = None, vocab_size: int | None = None,
           layer_params: list[int] | None = None) -> Choice:
    """Estimate every layout the plan accepts for this config; raise :class:`PlanError` when none is
    accepted or none fits. ``machine``: this machine's facts (a cluster launcher plans for its nodes,
    :func:`~hybridtrain.plan.devices.planned_machine`); ``vocab_size``: the tokenizer's (default: the
    model's); ``layer_params``: for ``parallel.partition=parameters``."""
    from hybridtrain.models.families import family_of, head_dim_of, kv_heads_of

    lau = cfg.launcher
    apply_world_size(cfg)
    machine = planned_machine(lau, machine)
    cfg.trainer.precision = precision_for(cfg.trainer.precision, lau, machine)
    world = world_size(cfg, machine)
    if world < 1:
        raise PlanError("plan.world_size", f"must be >= 1, got {world}")
    per_node = max(1, world // lau.nodes)
    threads = lau.threads_per_rank or max(1, machine.cpu_cores // per_node)
    hidden = int(getattr(hf_config, family_of(cfg.model).hidden))
    budget = memory_budget(cfg.plan, lau, machine, per_node)
    if not budget and uses_gpus(lau, machine):
        raise PlanError("plan.device_memory_gb", "parallel=auto on GPUs of unknown memory cannot keep a layout "
                        "within it: set plan.device_memory_gb (GiB of one GPU)"
                        + (", or launcher.gpu_type" if lau.name != "local" else ""))
    rates = rates or planned_rates(lau, machine, cfg.trainer.precision, cfg.trainer.tf32, threads,
                                   cfg.plan.calibrate, (cfg.data.seq_len, hidden), per_node)
    cache: dict[tuple[int, int], ModelFacts] = {}

    def facts_at(tp: int, cp: int = 1) -> ModelFacts:
        """The model's facts at tp; with cp > 1 at ``data.seq_len / cp`` (a rank's tokens, for its memory only:
        the time costs divide the whole row's facts by cp themselves)."""
        if (tp, cp) not in cache:
            cache[tp, cp] = model_facts(family_of(cfg.model), hf_config, cfg.data.seq_len // cp, tp,
                                        vocab_pad_multiple(cfg, machine), score_head=has_score_head(cfg))
        return cache[tp, cp]

    def facts_for_tp(tp: int) -> ModelFacts:
        return facts_at(tp)

    family = family_of(cfg.model)
    kv_width = kv_heads_of(family, hf_config) * head_dim_of(family, hf_config)
    vocab = vocab_size if vocab_size is not None else int(hf_config.vocab_size)
    scored: list[Candidate] = []
    refused: list[tuple[Candidate, PlanError]] = []

    top_k = int(getattr(hf_config, family.moe.top_k)) if family.moe is not None else 0
    eps = expert_degrees(family, hf_config, world)

    def score(cps: list[int]) -> None:
        for c in candidates(cfg, world, cps, eps):
            trial = c.config(cfg)
            try:
                plan = build_plan(trial, hf_config, machine, vocab, layer_params, facts_for_tp)
            except PlanError as err:
                refused.append((c, err))
                continue
            scored.append(estimate(c, plan, facts_at(c.tp), trial, rates, per_node, machine.cpu_cores, kv_width, top_k))

    # Every cp degree the row allows: a cp layout splits the compute as dp does and adds the keys' and values'
    # all-gathers, so the cost model ranks it below dp of the same ranks, and above whole rows where they fit
    # only with activation checkpointing (its recomputed forward costs more than the gathers), where dp is
    # out of batch, or where nothing of whole rows fits the budget (a long sequence).
    score(context_degrees(cfg.data.seq_len, world))
    if not scored:
        example = ""
        if refused:
            c, err = refused[-1]
            example = f"; e.g. {c.label()}: {err}"
        raise PlanError("plan.world_size", f"no layout of {world} ranks passes the plan's rules with "
                        f"trainer.global_batch_size={cfg.trainer.global_batch_size}{example}; change the world "
                        "size or the batch")
    fitting = [c for c in scored if not budget or c.memory <= budget]
    if not fitting:
        least = min(scored, key=lambda c: c.memory)
        raise PlanError("plan.device_memory_gb", f"no layout of {world} ranks fits {budget / 2**30:.2f} GiB per "
                        f"rank; the smallest needs {least.memory / 2**30:.2f} GiB ({least.label()}): "
                        "add ranks (plan.world_size) or devices with more memory")
    # fastest first; among equal times the least memory, then the simplest layout
    ranked = sorted(fitting, key=lambda c: (round(c.step_time, 12), c.memory, c.cp * c.ep * c.tp * c.pp, c.zero_stage))
    return Choice(ranked[0], ranked, len(scored) + len(refused), len(scored) - len(fitting), budget, rates,
                  refused=len(refused))


def estimate_layout(cfg: Config, hf_config, machine: Machine, rates: Rates) -> Candidate:
    """The cost model's estimate of the one layout ``cfg.parallel`` holds (its cp included), as :func:`search`
    would score it: what a recipe's arithmetic and ``bench/bench_cp.py`` quote for a fixed layout. Raises the
    plan's :class:`PlanError` if the plan refuses it."""
    from hybridtrain.models.families import family_of, head_dim_of, kv_heads_of

    machine = planned_machine(cfg.launcher, machine)
    vocab = int(hf_config.vocab_size)
    plan = build_plan(cfg, hf_config, machine, vocab)
    family = family_of(cfg.model)
    pad = vocab_pad_multiple(cfg, machine)
    dims, par = plan.dims, cfg.parallel
    c = Candidate(dims.dp, dims.tp, dims.pp, plan.micro_batch_size, plan.zero_stage, bool(par.activation_checkpointing),
                  cp=dims.cp, ep=dims.ep)
    facts = model_facts(family, hf_config, cfg.data.seq_len, dims.tp, pad, score_head=has_score_head(cfg))
    per_node = max(1, plan.world_size // plan.nodes)
    top_k = int(getattr(hf_config, family.moe.top_k)) if family.moe is not None else 0
    return estimate(c, plan, facts, cfg, rates, per_node, machine.cpu_cores,
                    kv_heads_of(family, hf_config) * head_dim_of(family, hf_config), top_k)


def apply(cfg: Config, best: Candidate) -> None:
    """Write the chosen layout into ``cfg.parallel`` (what the run then uses)."""
    par = cfg.parallel
    par.dp, par.cp, par.ep, par.tp, par.pp = best.dp, best.cp, best.ep, best.tp, best.pp
    par.micro_batch_size, par.zero_stage = best.micro_batch_size, best.zero_stage
    par.activation_checkpointing = best.activation_checkpointing
    par.auto = False
