"""Data rules of the plan: the ``data`` keys before tokenization, the sample counts after it.

:func:`check_data_config` runs inside :func:`~hybridtrain.plan.validate.build_plan` (also in dry
runs); :func:`check_data_counts` runs in the controller once the data is tokenized, and derives
``trainer.max_steps`` from ``trainer.epochs``. Both raise :class:`PlanError` naming the key and a fix.
"""
from __future__ import annotations

import math

from hybridtrain.config.choices import Packing
from hybridtrain.config.schema import Config, DataConfig, TrainerConfig
from hybridtrain.errors import PlanError
from hybridtrain.plan.types import Plan


def _need(ok: bool, key: str, message: str) -> None:
    if not ok:
        raise PlanError(key, message)


def has_validation(data: DataConfig) -> bool:
    """Whether the run has validation records (a fraction, a path or a split)."""
    return data.val_fraction > 0 or bool(data.val_path) or bool(data.val_split)


def check_data_config(data: DataConfig, trainer: TrainerConfig) -> None:
    """The ``data`` keys (and the trainer's data keys) on their own, before anything is read."""
    # data.source, data.format and data.sample_by are fixed choices, checked while composing (config/choices.py)
    if data.source == "embedded":
        _need(data.name in (None, "embedded"), "data.name",
              f"{data.name!r} names a hub dataset, but data.source=embedded; use data=hf data.name={data.name} "
              "(or data=files / data=disk with data.path)")
    if data.source in ("files", "disk"):
        _need(bool(data.path), "data.path", f"data.source={data.source} needs data.path (a path or glob)")
    if data.source == "hf":
        _need(bool(data.name), "data.name", "data.source=hf needs data.name (a hub dataset such as org/name)")
    _need(data.num_proc >= 1, "data.num_proc", f"must be >= 1, got {data.num_proc}")
    _need(data.seq_len >= 1, "data.seq_len", f"must be >= 1, got {data.seq_len}")
    _need(0 <= data.val_fraction < 1, "data.val_fraction", f"must be in [0, 1), got {data.val_fraction}")
    given = [k for k, v in (("data.val_path", data.val_path), ("data.val_split", data.val_split)) if v]
    _need(not (data.val_fraction > 0 and given), "data.val_fraction",
          f"{data.val_fraction} and {given[0] if given else ''} both define validation records; use one of them")
    _need(not data.val_path or data.source in ("files", "disk"), "data.val_path",
          f"only for data.source=files or disk (this run: {data.source}); use data.val_fraction or data.val_split")
    _need(not data.val_split or data.source in ("hf", "disk"), "data.val_split",
          f"only for data.source=hf or disk (this run: {data.source}); use data.val_fraction or data.val_path")
    _need(trainer.eval_every >= 0, "trainer.eval_every", f"must be >= 0 (0: only at the end), got {trainer.eval_every}")
    _need(trainer.eval_every == 0 or has_validation(data), "trainer.eval_every",
          f"{trainer.eval_every} needs validation records; set data.val_fraction (e.g. 0.05), data.val_path or "
          "data.val_split, or trainer.eval_every=0")
    _need(trainer.epochs is None or trainer.epochs > 0, "trainer.epochs",
          f"must be > 0 or null (use trainer.max_steps), got {trainer.epochs}")


DOCUMENT_MASKS = {
    "sdpa": "transformers' block-causal boolean mask (from the restarting position ids)",
    "eager": "transformers' block-causal additive mask (from the restarting position ids)",
    "flash_attention_2": "FlashAttention 2's variable-length kernels (cu_seqlens at every restart)",
}
"""Attention kernels that keep packed records apart, and how (``models/stages.py``, ``DecoderBlock``)."""


def check_packing_kernel(data: DataConfig, attn_implementation: str) -> None:
    """``data.packing=documents`` needs a kernel that can express the records' block-causal mask."""
    kernel = str(attn_implementation)
    if Packing.of(data.packing, data.format) is Packing.documents and kernel not in DOCUMENT_MASKS:
        raise PlanError("data.packing", f"documents packs several records into a row and needs an attention kernel "
                        f"that keeps them apart, but model.attn_implementation={kernel} cannot express that mask; "
                        f"use model.attn_implementation in {sorted(DOCUMENT_MASKS)} or data.packing=none")


def check_data_counts(cfg: Config, plan: Plan, train_samples: int, val_samples: int) -> int:
    """Check the tokenized sample counts against the batch; return ``trainer.max_steps`` (derived from
    ``trainer.epochs`` when that is set: ``floor(epochs x train_samples / global_batch_size)``)."""
    gbs, seq = plan.global_batch_size, plan.seq_len
    _need(train_samples >= gbs, "trainer.global_batch_size",
          f"the data has only {train_samples} training samples of data.seq_len={seq} tokens, fewer than one global "
          f"batch of {gbs}; lower trainer.global_batch_size or data.seq_len, or add data")
    if has_validation(cfg.data):
        key = "data.val_fraction" if cfg.data.val_fraction > 0 else ("data.val_path" if cfg.data.val_path else "data.val_split")
        _need(val_samples >= gbs, key,
              f"the validation split has {val_samples} samples, fewer than one global batch of {gbs} (validation "
              "runs in whole global batches); give more validation records or lower trainer.global_batch_size")
    if cfg.trainer.epochs is None:
        return cfg.trainer.max_steps
    steps = math.floor(cfg.trainer.epochs * train_samples / gbs)
    _need(steps >= 1, "trainer.epochs", f"{cfg.trainer.epochs} epoch(s) of {train_samples} samples is less than one "
          f"global batch of {gbs}; raise trainer.epochs")
    _need(cfg.optim.warmup_steps <= steps, "optim.warmup_steps",
          f"{cfg.optim.warmup_steps} exceeds the {steps} steps that trainer.epochs={cfg.trainer.epochs} gives; "
          "lower optim.warmup_steps")
    return steps
