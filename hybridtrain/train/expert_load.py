"""The expert load of an expert-parallel run, watched per step (GPU review 3, finding 11 b).

The dispatch is dropless (:class:`~hybridtrain.parallel.experts.ExpertDispatch`): a rank's experts run every pair
routed to them, and the plan makes room for :data:`~hybridtrain.plan.memory.EXPERT_LOAD_MARGIN` times the pairs a
rank's own tokens send. That margin was measured on random routers; a pretrained router on small micro-batches can
send one rank more. Each step the ranks keep their largest ratio (from the split sizes the dispatch reads anyway);
on a log step one max all-reduce over the world gives ``moe/expert_load_max`` in ``metrics.jsonl``, and the first
step above the margin is said once, with the margin the run would need.
"""
from __future__ import annotations

from typing import Any

EXPERT_LOAD_METRIC = "moe/expert_load_max"
"""The metric: the most pairs any rank's experts ran in one forward since the last log step, over its own pairs."""


class ExpertLoad:
    """The per-step watch of one run's expert-parallel layers (none at ``ep`` = 1: :meth:`of` gives ``None``)."""

    def __init__(self, dispatches: list, margin: float, say=print):
        self.dispatches = dispatches
        self.margin = margin
        self.say = say
        self.peak = 0.0
        self.warned = False

    @classmethod
    def of(cls, built: Any, ep: int, is_rank0: bool) -> "ExpertLoad | None":
        """The watch of ``built``'s model when it splits experts over ``ep`` > 1 ranks (every rank: the log
        step's all-reduce needs them all; a stage without MoE blocks contributes 0)."""
        if ep <= 1:
            return None
        from hybridtrain.parallel.experts import ExpertDispatch
        from hybridtrain.plan.memory import EXPERT_LOAD_MARGIN

        dispatches = [m.forward for m in built.engine.module.modules() if isinstance(m.forward, ExpertDispatch)]
        return cls(dispatches, EXPERT_LOAD_MARGIN, say=print if is_rank0 else (lambda *_a, **_k: None))

    def step(self, step: int, device: Any, log_now: bool) -> dict[str, float]:
        """After every step: this rank's peak kept; on a log step the world's, as the metric (and the warning)."""
        for d in self.dispatches:
            self.peak = max(self.peak, d.take_peak_load())
        if not log_now:
            return {}
        import torch

        from hybridtrain.parallel import collectives

        peak = float(collectives.all_reduce(torch.tensor([self.peak], dtype=torch.float64), device, op="max")[0])
        self.peak = 0.0
        if peak > self.margin and not self.warned:
            self.warned = True
            self.say(f"[hybridtrain] expert load: at step {step} a rank's experts ran {peak:.2f} times the pairs its "
                     f"own tokens sent, above the {self.margin} the plan's memory estimate makes room for "
                     f"(hybridtrain.plan.memory.EXPERT_LOAD_MARGIN): that rank's expert activations are "
                     f"{peak / self.margin:.2f} times the plan's; where memory is tight, lower parallel.micro_batch_size "
                     "or turn on parallel.activation_checkpointing (docs/moe.md#memory)", flush=True)
        return {EXPERT_LOAD_METRIC: peak}
