"""``finetune.objective=dpo`` around the loop: the reference log-probabilities before training, the per-step
metrics after each step.

The reference log-probabilities of every training pair are computed once, before training, by the run's own
engine under its own plan: a no-grad pass over the pairs in index order with the initial weights, through the
same loss function in its recording mode, so they are exact under tp, cp and pp as the training
log-probabilities are. With ``finetune.method=lora`` and fresh adapters the reference is the base model,
adapters off (:func:`~hybridtrain.parallel.lora.adapters_off`; fresh adapters add 0 anyway); with
``finetune.lora.init_from`` it is the initial policy, base plus the adapter it starts from, as TRL's
``DPOTrainer`` makes a frozen ``ref`` copy of a pretrained adapter. They are cached beside the tokenized data
(``DATA_DIR/reference-KEY.npy``), keyed by the data and the model (its folder's files, or its config and
seed, and a LoRA run's starting adapter) and the precision, so a second run of the same model on the same
data (any layout; full or fresh LoRA: the reference is the base model either way) and a resumed run read
them back. TRL's
``precompute_ref_log_probs=True`` does the same with its reference model.
"""
from __future__ import annotations

import hashlib
import json
import os
from pathlib import Path
from typing import Any, Callable

import numpy as np

from hybridtrain.objectives import STATS


def reference_key(cfg: Any, plan: Any, data_dir: str) -> str:
    """16 hex digits naming the reference cache of this model, precision and data."""
    from dataclasses import asdict

    model = json.loads(json.dumps(asdict(cfg.model), default=str))
    files = []
    if cfg.model.pretrained:
        folder = Path(cfg.model.pretrained).expanduser().resolve()
        model["pretrained"] = str(folder)
        files = [(p.name, p.stat().st_size, p.stat().st_mtime_ns) for p in sorted(folder.iterdir())
                 if p.suffix in (".json", ".safetensors")]
    else:  # a seeded initialisation: the same under every plan
        model["seed"] = cfg.trainer.seed
    if cfg.finetune.method == "lora" and cfg.finetune.lora.init_from:  # the reference holds the starting adapter
        adapter = Path(cfg.finetune.lora.init_from).expanduser().resolve()
        files += [(str(p), p.stat().st_size, p.stat().st_mtime_ns) for p in sorted(adapter.iterdir()) if p.is_file()]
    blob = json.dumps({"model": model, "files": files, "precision": plan.precision, "data": Path(data_dir).name},
                      sort_keys=True)
    return hashlib.sha256(blob.encode()).hexdigest()[:16]


def reference_file(data_dir: str, key: str) -> Path:
    """Where the reference log-probabilities of ``key`` are cached: ``[pairs, 2]`` float64 (chosen, rejected)."""
    return Path(data_dir) / f"reference-{key}.npy"


def _forward_all(built: Any, samples: Any, plan: Any) -> None:
    """Every pair once (the last global batch filled up with the first pairs), through the engine without gradients."""
    import torch

    layout = plan.batch_layout()
    engine = built.engine
    if plan.dims.pp == 1:
        engine.eval()
    try:
        for micro in samples.reference_batches(layout, built.dp_rank):
            if plan.dims.pp > 1:
                engine.eval_batch(iter(micro), reduce_output=None, bcast_loss=False,
                                  num_micro_batches=layout.grad_accum)
                continue
            with torch.no_grad():
                for inputs, target in micro:
                    engine(tuple(t.to(engine.device) for t in inputs), tuple(t.to(engine.device) for t in target))
    finally:
        engine.train()


def compute_reference(built: Any, samples: Any, plan: Any, base_only: bool) -> np.ndarray:
    """The pairs' reference log-probabilities ``[num_samples, 2]``, the same on every rank: each rank that ran
    the loss (the last stage; every tp and cp rank there holds the whole sums) recorded its pairs, and one
    all-reduce over the world of the sums and their counts gives each pair's value. ``base_only``: with the
    LoRA adapters off."""
    from contextlib import nullcontext

    import torch

    from hybridtrain.parallel import collectives
    from hybridtrain.parallel.lora import adapters_off

    loss = built.objective
    loss.recording = []
    try:
        with adapters_off(built.engine.module) if base_only else nullcontext():
            _forward_all(built, samples, plan)
        recorded = loss.recording
    finally:
        loss.recording = None
    total = torch.zeros((samples.num_samples, 3), dtype=torch.float64)  # chosen, rejected, times recorded
    for index, logps in recorded:
        total[index, :2] += logps
        total[index, 2] += 1
    total = collectives.all_reduce(total, built.engine.device).cpu()
    assert bool((total[:, 2] > 0).all()), "a pair was never recorded by the reference pass"
    return (total[:, :2] / total[:, 2:]).numpy()


def attach_reference(cfg: Any, plan: Any, built: Any, samples: Any, data_dir: str, initial_weights: bool,
                     is_rank0: bool, log: Callable[[str], None] = print) -> None:
    """Give ``samples`` (:class:`~hybridtrain.data.sampler.PairSamples`) its reference log-probabilities: read
    from the cache, else computed (only with the initial weights: not after a checkpoint's weights were
    loaded) and written there by rank 0. Every rank calls it (the pass is collective). Also for ``sft`` alone,
    which needs no reference, as TRL computes one: the rewards of the metrics are relative to it."""
    path = reference_file(data_dir, reference_key(cfg, plan, data_dir))
    if path.is_file():
        samples.reference = np.load(path)
        if is_rank0:
            log(f"[hybridtrain] dpo       reference log-probabilities read from {path}")
        return
    if not initial_weights:
        raise RuntimeError(f"the reference log-probabilities of this run ({path}) are gone and the weights loaded "
                           "are a checkpoint's, not the initial ones; restore the file or start the run afresh")
    fresh_lora = cfg.finetune.method == "lora" and not cfg.finetune.lora.init_from
    samples.reference = compute_reference(built, samples, plan, base_only=fresh_lora)
    if is_rank0:
        part = path.with_suffix(f".{os.getpid()}.tmp.npy")
        np.save(part, samples.reference)
        os.replace(part, path)  # atomic: a concurrent run never reads a partial file
        log(f"[hybridtrain] dpo       reference log-probabilities of {samples.num_samples} pairs computed "
            f"(no-grad pass under this plan) and cached in {path}")


def step_metrics(built: Any, log_now: bool) -> dict[str, float]:
    """TRL's per-step metrics (:data:`~hybridtrain.objectives.dpo.STATS`, or the objective's ``names``: a reward
    model's :data:`~hybridtrain.objectives.reward.STATS`), means over the step's pairs, on a
    log step (every rank calls it after every step; one all-reduce over the world on log steps). The ranks
    that computed no loss add zeros; the tp and cp ranks of one replica, which all hold the same values, count
    their pairs as often as their sums, so the means are exact."""
    if built.objective is None:
        return {}
    from hybridtrain.parallel import collectives

    sums = built.objective.take_stats(built.engine.device)
    if not log_now:
        return {}
    sums = collectives.all_reduce(sums, built.engine.device).cpu()
    if hasattr(built.objective, "metrics"):  # cpo / orpo: their own names and denominators
        return built.objective.metrics(sums)
    count = max(float(sums[-1]), 1.0)
    names = getattr(built.objective, "names", STATS)  # a reward model's: RewardLoss.names
    return {name: float(sums[k]) / count for k, name in enumerate(names)}
