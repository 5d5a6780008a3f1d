"""Validation loss and perplexity, computed the same way under every plan.

The validation split is read in a fixed order (:meth:`~hybridtrain.data.sampler.Samples.eval_batches`):
consecutive global batches of the training ``global_batch_size`` and ``micro_batch_size``, the
remainder dropped, each laid out ``[accumulation, dp, micro]`` like a training batch. A batch's
loss is the mean over its loss-carrying tokens (micro-batches return weighted token sums, see
:meth:`~hybridtrain.data.sampler.Samples.batch_weight`), exactly as a training step reports it; ``val_loss`` is the mean over the
batches and ``val_ppl = exp(val_loss)``. Every rank returns the same numbers.
"""
from __future__ import annotations

import math
import time
from pathlib import Path
from typing import Any

from hybridtrain.data.sampler import Samples, open_samples
from hybridtrain.parallel.dims import BatchLayout
from hybridtrain.engine import Built
from hybridtrain.rundir import RunDir


def _loss_pipeline(built: Built, micro: list[tuple], layout: BatchLayout) -> float:
    # DeepSpeed averages over micro-batches and dp ranks, then broadcasts from the last stage to
    # every stage (bcast_loss), so each rank gets the global-batch loss.
    out = built.engine.eval_batch(iter(micro), reduce_output="avg", bcast_loss=True,
                                  num_micro_batches=layout.grad_accum)
    return float(out)


def _loss_sequential(built: Built, micro: list[tuple], layout: BatchLayout) -> float:
    import torch

    from hybridtrain.parallel import collectives

    engine = built.engine
    total = torch.zeros((), dtype=torch.float32, device=engine.device)
    with torch.no_grad():
        for inputs, target in micro:
            inputs = tuple(t.to(engine.device) for t in inputs)  # (input_ids, position_ids)
            total += engine(inputs, tuple(t.to(engine.device) for t in target)).float()
    total /= layout.grad_accum
    if layout.averaged_over > 1:
        total = collectives.all_reduce(total, engine.device, group=built.groups.data_group) / layout.averaged_over
    return float(total)


class Evaluator:
    """Runs the validation split through the engine at the steps ``trainer.eval_every`` asks for."""

    def __init__(self, samples: Samples, layout: BatchLayout, eval_every: int, max_steps: int, pipelined: bool):
        self.samples, self.layout = samples, layout
        self.eval_every, self.max_steps, self.pipelined = eval_every, max_steps, pipelined

    @classmethod
    def from_run_dir(cls, run_dir: Path, cfg, plan, built: Built) -> "Evaluator | None":
        """The run's evaluator, or ``None`` when ``data.json`` holds no validation split."""
        data_json = RunDir(run_dir).data_file
        samples = open_samples(data_json, "val", cfg.trainer.seed) if data_json.is_file() else None
        if samples is None:
            return None
        layout = plan.batch_layout()
        return cls(samples, layout, cfg.trainer.eval_every, cfg.trainer.max_steps, plan.dims.pp > 1)

    def due(self, step: int) -> bool:
        """Whether to evaluate after optimizer step ``step`` (1-based): every ``eval_every`` and the last."""
        return step == self.max_steps or (self.eval_every > 0 and step % self.eval_every == 0)

    def run(self, built: Built, step: int) -> dict[str, Any]:
        """Evaluate the whole validation split; the ``metrics.jsonl`` record of ``step``."""
        engine = built.engine
        t0 = time.perf_counter()
        losses = []
        if not self.pipelined:
            engine.eval()
        try:
            for micro in self.samples.eval_batches(self.layout, built.dp_rank, weighted=True):
                step_loss = _loss_pipeline if self.pipelined else _loss_sequential
                losses.append(step_loss(built, micro, self.layout))
        finally:
            engine.train()  # the pipeline engine's eval_batch leaves its module in eval mode
        val_loss = sum(losses) / len(losses)
        return {"step": step, "val_loss": val_loss, "val_ppl": math.exp(min(val_loss, 700.0)),
                "val_batches": len(losses), "val_time_s": time.perf_counter() - t0}
