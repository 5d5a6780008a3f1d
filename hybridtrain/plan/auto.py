"""``parallel=auto``: enumerate the layouts that fit, estimate each one's step time, pick the fastest.

A candidate is (dp, tp, pp, micro-batch size, ZeRO stage, activation checkpointing) with
``dp x tp x pp = plan.world_size``. Memory comes from :mod:`hybridtrain.plan.memory`; the step
time from a cost model on :class:`~hybridtrain.plan.calibrate.Rates` measured on this machine:

* compute: each stage's forward + backward FLOP-equivalents (:mod:`hybridtrain.plan.costs`,
  plus one more forward of the blocks under activation checkpointing) at the probed matmul rate
  (a matmul of the model's width), plus the probed fixed overhead per layer call, both slowed by
  ``ranks x threads / cores`` when a node's ranks oversubscribe its CPU cores;
* tensor parallelism: 2 all-reduces of ``[b, s, h]`` per block forward and 2 backward, 1 for the
  vocabulary-parallel embedding and 4 for the head and loss, at the probed latency and bandwidth
  (probed with as many processes as the node's ranks);
* pipeline: a send of ``[b, s, h]`` forward and one backward per micro-batch and boundary;
  1F1B takes ``(m + pp - 1)`` slots of the slowest stage (the bubble);
* data parallelism: the ring all-reduce of the stage's gradients once per step, plus the
  all-gather of the updated partitions (ZeRO-1/2: 1.5x) and of the parameters in forward and
  backward (ZeRO-3: 2.5x), and the AdamW update of the rank's share.
"""
from __future__ import annotations

from dataclasses import dataclass, field, replace

from hybridtrain.config.schema import Config
from hybridtrain.models.units import Kind
from hybridtrain.plan.calibrate import Rates
from hybridtrain.plan.costs import ELEMENTWISE_COST, ModelFacts, layer_time_costs, model_facts
from hybridtrain.plan.memory import attention_flags, device_memory_bytes, rank_memory, stage_param_sizes
from hybridtrain.plan.partition import balanced
from hybridtrain.errors import PlanError
from hybridtrain.plan.types import Machine
from hybridtrain.plan.validate import vocab_pad_multiple

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
    step_time: float = 0.0
    """Estimated seconds per optimizer step."""
    memory: int = 0
    """Estimated bytes of the fullest rank."""
    parts: dict = field(default_factory=dict, compare=False)
    """Seconds per step by cause: compute, tp_comm, pp_comm, bubble, dp_comm, optimizer."""
    bounds: tuple = ()

    def label(self) -> str:
        return (f"dp={self.dp} tp={self.tp} pp={self.pp} micro={self.micro_batch_size} "
                f"ZeRO-{self.zero_stage} ckpt={'on' if self.activation_checkpointing else 'off'}")


def _divisors(n: int) -> list[int]:
    return [d for d in range(1, n + 1) if n % d == 0]


def _allreduce(nbytes: float, n: int, rates: Rates) -> float:
    return 0.0 if n <= 1 else rates.latency + 2 * (n - 1) / n * nbytes / rates.bandwidth


def estimate(c: Candidate, facts: ModelFacts, cfg: Config, rates: Rates, ranks_per_node: int,
             cores: int, device_memory: int) -> Candidate:
    """``c`` with its step time, memory, stage bounds and time breakdown filled in."""
    s, h = facts.seq_len, facts.hidden
    w = 4 if cfg.trainer.precision == "fp32" else 2
    m = cfg.trainer.global_batch_size // (c.micro_batch_size * c.dp)
    tokens = c.micro_batch_size * s
    costs = layer_time_costs(facts, tokens, c.tp)
    if c.activation_checkpointing:  # one more forward of every block (1/3 of its training FLOPs)
        costs = [x + (u.flops * tokens / c.tp / 3 if u.kind is Kind.BLOCK else 0.0)
                 for x, u in zip(costs, facts.units)]
    bounds = balanced(costs, c.pp) if c.pp > 1 else [0, len(costs)]
    rate = rates.flops
    if rates.device == "cpu":
        rate *= min(1.0, cores / (ranks_per_node * rates.threads))
    act = tokens * h * w
    per_stage, tp_comm = [], 0.0
    for st in range(c.pp):
        units = facts.units[bounds[st]:bounds[st + 1]]
        slow = 1.0 if rates.device != "cpu" else max(1.0, ranks_per_node * rates.threads / cores)
        compute = sum(costs[bounds[st]:bounds[st + 1]]) / rate + len(units) * rates.layer_overhead * slow
        blocks = sum(u.kind is Kind.BLOCK for u in units)
        comm = 4 * blocks * _allreduce(act, c.tp, rates)
        # vocabulary parallel: the embedding's output, the head's input gradient, the loss's max,
        # sum of exponentials and target logit
        comm += (any(u.kind is Kind.EMBED for u in units) + 4 * any(u.kind is Kind.HEAD for u in units)) * (
            _allreduce(act, c.tp, rates))
        send = 2 * (rates.latency + act / rates.bandwidth) if c.pp > 1 else 0.0
        per_stage.append(compute + comm + send)
        tp_comm = max(tp_comm, comm)
    slowest = max(per_stage)
    pipeline = (m + c.pp - 1) * slowest
    worst_mem, dp_comm, optim = 0, 0.0, 0.0
    for st in range(c.pp):
        units = facts.units[bounds[st]:bounds[st + 1]]
        params = sum(stage_param_sizes(units, c.tp))
        dp_comm = max(dp_comm, DP_VOLUME[c.zero_stage] * _allreduce(params * w, c.dp, rates))
        share = params if c.zero_stage == 0 else params / c.dp
        optim = max(optim, OPTIMIZER_COST * ELEMENTWISE_COST * share / rate)
        mem = rank_memory(facts, bounds, st, tp=c.tp, pp=c.pp, dp=c.dp, zero=c.zero_stage,
                          precision=cfg.trainer.precision, micro_batch=c.micro_batch_size, micro_batches=m,
                          checkpointing=c.activation_checkpointing, **attention_flags(cfg))
        worst_mem = max(worst_mem, mem.total)
    total = pipeline + dp_comm + optim
    parts = {"compute+comm per micro-batch (slowest stage)": slowest, "micro-batches": m,
             "bubble": (c.pp - 1) * slowest, "tp_comm per micro-batch": tp_comm, "dp_comm": dp_comm,
             "optimizer": optim}
    return replace(c, step_time=total, memory=worst_mem, parts=parts, bounds=tuple(bounds))


def candidates(cfg: Config, facts_for_tp, world: int) -> list[Candidate]:
    """Every layout the plan rules allow for ``world`` ranks (tp dividing heads, KV heads, MLP width
    and the vocabulary padding; pp up to the blocks; ZeRO 0-1 with pp > 1; micro dividing the batch)."""
    out = []
    G = cfg.trainer.global_batch_size
    for tp in _divisors(world):
        facts = facts_for_tp(tp)
        if facts is None:
            continue
        for pp in _divisors(world // tp):
            if pp > facts.num_layers:
                continue
            dp = world // (tp * pp)
            if G % dp:
                continue
            for micro in _divisors(G // dp):
                for zero in ((0, 1) if pp > 1 else (0, 1, 2, 3)):
                    if zero and dp == 1 and zero > 1:
                        continue  # ZeRO-2/3 over one replica is ZeRO-1 with more work
                    for ckpt in (False, True):
                        out.append(Candidate(dp, tp, pp, micro, zero, ckpt))
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

    def explain(self, top: int = 5) -> str:
        """Why this plan: its estimated time and memory, what the time is made of, the runners-up."""
        b = self.best
        gib = 2**30
        lines = [f"auto      {self.considered} layouts considered, {self.over_memory} over "
                 f"{self.device_memory / gib:.2f} GiB per rank; cost model at {self.rates.flops / 1e9:.1f} "
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


def search(cfg: Config, hf_config, machine: Machine, rates: Rates | None = None) -> Choice:
    """Estimate every candidate for this config; raise :class:`PlanError` when none fits."""
    from hybridtrain.models.families import family_of, mlp_width_of
    from hybridtrain.plan.calibrate import rates as probe

    world = world_size(cfg, machine)
    if world < 1:
        raise PlanError("plan.world_size", f"must be >= 1, got {world}")
    per_node = max(1, world // cfg.launcher.nodes)
    threads = cfg.launcher.threads_per_rank or max(1, machine.cpu_cores // per_node)
    hidden = int(getattr(hf_config, family_of(cfg.model).hidden))
    if rates is None and not machine.gpus_per_node and cfg.launcher.nodes > 1:
        from hybridtrain.plan.calibrate import builtin  # a cluster plan made here: this CPU says nothing

        rates = builtin("cuda")
    rates = rates or probe(threads if not machine.gpus_per_node else 1, cfg.plan.calibrate,
                           (cfg.data.seq_len, hidden), per_node)
    family = family_of(cfg.model)
    shape = [getattr(hf_config, family.heads), mlp_width_of(family, hf_config)]
    if family.kv_heads and getattr(hf_config, family.kv_heads, None):
        shape.append(getattr(hf_config, family.kv_heads))
    cache: dict[int, ModelFacts | None] = {}

    def facts_for_tp(tp: int) -> ModelFacts | None:
        if tp not in cache:
            ok = all(int(v) % tp == 0 for v in shape)
            cache[tp] = model_facts(family_of(cfg.model), hf_config, cfg.data.seq_len, tp,
                                    vocab_pad_multiple(cfg, machine)) if ok else None
        return cache[tp]

    budget = device_memory_bytes(cfg.plan, machine, per_node)
    scored = [estimate(c, facts_for_tp(c.tp), cfg, rates, per_node, machine.cpu_cores, budget)
              for c in candidates(cfg, facts_for_tp, world)]
    if not scored:
        raise PlanError("plan.world_size", f"no layout of {world} ranks divides the model "
                        f"(heads/KV heads/MLP width {shape}) and trainer.global_batch_size="
                        f"{cfg.trainer.global_batch_size}; change the world size or the batch")
    fitting = [c for c in scored if not budget or c.memory <= budget]
    if not fitting:
        least = min(scored, key=lambda c: c.memory)
        raise PlanError("plan.device_memory_gb", f"no layout of {world} ranks fits {budget / 2**30:.2f} GiB per "
                        f"rank; the smallest needs {least.memory / 2**30:.2f} GiB ({least.label()}): "
                        "add ranks (plan.world_size) or devices with more memory")
    # fastest first; among equal times the least memory, then the simplest layout
    ranked = sorted(fitting, key=lambda c: (round(c.step_time, 12), c.memory, c.tp * c.pp, c.zero_stage))
    return Choice(ranked[0], ranked, len(scored), len(scored) - len(fitting), budget, rates)


def apply(cfg: Config, best: Candidate) -> None:
    """Write the chosen layout into ``cfg.parallel`` (what the run then uses)."""
    par = cfg.parallel
    par.dp, par.tp, par.pp = best.dp, best.tp, best.pp
    par.micro_batch_size, par.zero_stage = best.micro_batch_size, best.zero_stage
    par.activation_checkpointing = best.activation_checkpointing
    par.auto = False
