"""Resume under another (dp, tp, pp, ep): optimizer state through HF names.

A checkpoint stores, besides DeepSpeed's own (plan-specific) state, every weight and every
AdamW moment as a full HF-named tensor (``hf/`` and ``optim/``). Resuming under a different plan
builds the model from ``hf/`` like a fine-tune, then puts each rank's slice of the moments into
DeepSpeed's optimizer through its ``safe_set_full_optimizer_state`` API, and sets the step and the
schedule. Written here rather than through DeepSpeed's offline universal-checkpoint converter,
whose merge needs per-parameter patterns for fused q|k|v and padded vocabularies and would still
leave the HF export to do; this path is online, plan-free and shares the HF name mapping.

Every resume of an expert-parallel run (``parallel.ep`` > 1 in the checkpoint or in the run) takes this path:
DeepSpeed's ``ds/`` model state, written by data-parallel rank 0, holds that rank's ``E / ep`` experts only (its
MoE save writes other ranks' experts only for DeepSpeed's own MoE layers, which hybridtrain does not use), while
``hf/`` and ``optim/`` hold every expert, gathered over the expert-parallel group at the save. Each rank reads
its ``E / ep`` experts of each MoE layer back.
"""
from __future__ import annotations

from pathlib import Path
from typing import Callable

import torch

from hybridtrain.parallel.context import EPContext, TPContext
from hybridtrain.parallel.slicing import Split, shard_tensor

MOMENTS = ("exp_avg", "exp_avg_sq")


def from_hf(tensor: torch.Tensor, split: Split, tp: TPContext, padded_vocab: int) -> torch.Tensor:
    """HF layout -> this rank's local shard (transpose, pad the vocabulary, slice fused-aware)."""
    t = tensor.t() if split.transpose else tensor
    if split.vocab is not None and t.shape[0] < padded_vocab:
        t = torch.cat([t, t.new_zeros(padded_vocab - t.shape[0], *t.shape[1:])])
    if split.dim is None or tp.size == 1:
        return t.contiguous()
    return shard_tensor(t, split.dim, split.fused, tp.rank, tp.size)


def read_local(weights, name: str, split: Split, tp: TPContext, padded_vocab: int,
               ep: EPContext | None = None) -> torch.Tensor:
    """:func:`from_hf` of tensor ``name`` of ``weights`` (a ``SafetensorsWeights``), reading only
    this rank's slice from the file (safetensors slicing), as float32; of an MoE layer's experts only this
    expert-parallel rank's ``E / ep`` (``ep``), each its TP slice."""
    from hybridtrain.models.weights import read_expert_rows, read_rows, read_shard

    if split.experts and ep is not None and ep.size > 1 and split.dim is None:  # gpt-oss's down_proj_bias [E, H]
        return read_expert_rows(weights, name, ep.rank, ep.size)
    if split.experts and ep is not None and ep.size > 1:  # the experts' HF layout is the local one
        assert split.dim is not None and not split.transpose and split.vocab is None, split
        return read_shard(weights, name, split.dim, split.fused, tp.rank, tp.size, (ep.rank, ep.size))
    if split.dim is None or tp.size == 1:
        return from_hf(weights.get(name), split, tp, padded_vocab)
    if split.vocab is not None:  # this rank's rows of the padded vocabulary; zeros past the real ones
        assert split.dim == 0 and not split.transpose and split.fused == 1, split
        lo, hi = tp.shard(padded_vocab)
        rows, _ = read_rows(weights, name, lo, hi)
        return torch.cat([rows, rows.new_zeros(hi - lo - rows.shape[0], *rows.shape[1:])])
    hf_dim = 1 - split.dim if split.transpose else split.dim  # Conv1D: HF [in, out], local [out, in]
    t = read_shard(weights, name, hf_dim, split.fused, tp.rank, tp.size)
    return (t.t() if split.transpose else t).contiguous()


def _prepare_zero_states(engine, step: int) -> None:
    """Create empty AdamW states (DeepSpeed creates them lazily at the first step) and link
    ZeRO's per-parameter fragments to them, so they can be written before training resumes."""
    zero = engine.optimizer
    base = getattr(zero, "optimizer", zero)
    fused = bool(base.defaults.get("fused"))  # torch's fused kernel wants its step count on the device
    for group in base.param_groups:
        for flat in group["params"]:
            count = torch.tensor(float(step), device=flat.device if fused else "cpu")
            base.state[flat] = {"step": count, "exp_avg": torch.zeros_like(flat),
                                "exp_avg_sq": torch.zeros_like(flat)}
    relink_zero_state(zero)


def relink_zero_state(zero) -> None:
    """(Re)build ZeRO-1/2's per-parameter views of the AdamW state.

    DeepSpeed links them once, right after the *first param group's* first step, so the views
    of every later group stay empty (deepspeed 0.19.8, ``stage_1_and_2.py``); relinking after all
    groups have state fixes that. A no-op for optimizers without ZeRO fragments.
    """
    if hasattr(zero, "_lazy_init_hp_params_optimizer_state"):
        zero._hp_optimizer_states_linked = False
        zero._lazy_init_hp_params_optimizer_state()


def load_moments(built, params: list, folder: Path, step: int, padded_vocab: int) -> None:
    """Put the AdamW moments saved under HF names in ``folder`` into this rank's optimizer."""
    from deepspeed.utils import safe_set_full_optimizer_state

    from hybridtrain.models.weights import SafetensorsWeights

    moments = SafetensorsWeights(folder)
    engine = built.engine
    zero = hasattr(engine.optimizer, "_lazy_init_hp_params_optimizer_state")
    _prepare_zero_states(engine, step)
    base = getattr(engine.optimizer, "optimizer", engine.optimizer)
    for name, param, split in params:
        for key in MOMENTS:
            local = read_local(moments, f"{key}.{name}", split, built.tp, padded_vocab, built.ep)  # this rank's slice
            if zero:
                safe_set_full_optimizer_state(param, local.to(param.device), key)
            else:  # ZeRO-0: the torch optimizer holds the parameters themselves
                base.state[param][key] = local.to(param.device)


def load_keeping_schedule(engine, plan, step: int, load: Callable[[], None]) -> None:
    """A same-plan resume: ``load()`` (DeepSpeed's ``load_checkpoint``), then this run's schedule at ``step``.

    deepspeed 0.19.8's ``load_checkpoint`` restores the scheduler's state (``base_lrs``: the saving run's
    ``optim.lr``, and ``last_epoch``) and, through the optimizer's ``load_state_dict``, every param group's
    hyperparameters as saved (``lr``: the old schedule's last value, ``initial_lr``, ``betas``, ``weight_decay``),
    which the first step would train with. The resuming run's own (built from its ``optim.*`` keys; the
    multipliers come from its ``trainer.max_steps`` and are never saved, a ``LambdaLR`` keeps no function in its
    state) are taken before the load and put back after it, so a same-plan resume follows the same schedule as a
    re-sharded one (:func:`set_schedule`). The AdamW moments and step counts are the checkpoint's, and so is the
    schedule's position (``last_epoch``: ``step``, less any fp16 step DeepSpeed skipped on an overflow, which
    does not advance the schedule), so an unchanged config resumes exactly."""
    sched = engine.lr_scheduler
    groups = [{k: v for k, v in group.items() if k != "params"} for group in sched.optimizer.param_groups]
    base_lrs = list(sched.base_lrs)
    load()
    position = sched.last_epoch
    for group, kept in zip(sched.optimizer.param_groups, groups, strict=True):
        group.update(kept)
    sched.base_lrs = base_lrs
    set_schedule(engine, plan, step, position)


def set_schedule(engine, plan, step: int, position: int | None = None) -> None:
    """Continue the learning-rate schedule at ``position`` (default ``step``: the optimizer steps taken) and
    DeepSpeed's counters at ``step``."""
    import warnings

    sched = engine.lr_scheduler
    sched.last_epoch = (step if position is None else position) - 1
    with warnings.catch_warnings():  # torch's "lr_scheduler.step() before optimizer.step()": moving it is the point
        warnings.filterwarnings("ignore", message="Detected call of `lr_scheduler.step", category=UserWarning)
        sched.step()  # sets every group's lr for optimizer step ``step``
    engine.global_steps = step
    engine.global_samples = step * plan.global_batch_size
