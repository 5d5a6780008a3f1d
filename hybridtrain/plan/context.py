"""The plan's rules for context parallelism (``parallel.cp``, ``docs/long-context.md``): what the model, the
data and the layout must satisfy before anything starts, each a :class:`~hybridtrain.errors.PlanError` naming
the key and the fix. Imports neither torch nor deepspeed."""
from __future__ import annotations

from typing import Any

from hybridtrain.errors import PlanError

CP_KERNELS = ("sdpa", "eager", "flash_attention_2")
"""Attention implementations context parallelism runs with (:mod:`hybridtrain.parallel.context_parallel`
wraps them: the keys and values are gathered; sdpa and eager get the full row's mask restricted to a rank's
queries, FlashAttention 2 one variable-length sequence per piece of a document)."""
FLASH_BOTTOM_RIGHT = (2, 1)
"""flash-attn from 2.1 aligns the causal mask of fewer queries than keys at the bottom right, which the pieces
of context parallelism rely on (older versions align it at the top left)."""


def flash_attn_version() -> tuple[int, int] | None:
    """The installed flash-attn's ``(major, minor)``, ``None`` when it is not installed (read from its metadata,
    without importing it)."""
    from importlib.metadata import PackageNotFoundError, version

    try:
        major, minor = version("flash_attn").split(".")[:2]
    except PackageNotFoundError:
        return None
    return int(major), int("".join(ch for ch in minor if ch.isdigit()) or 0)


def check_context_parallel(cfg: Any, family: Any, hf_config: Any) -> int:
    """The checked ``parallel.cp`` of a run: each row's ``data.seq_len`` tokens split in ``2 x cp`` equal
    chunks, an attention kernel the all-gather form wraps, and nothing the axis cannot do yet."""
    cp = int(cfg.parallel.cp)
    if cp < 1:
        raise PlanError("parallel.cp", f"must be >= 1 (1: every rank holds whole rows), got {cp}")
    if cp == 1:
        return cp
    if getattr(family, "context_parallel", None):
        raise PlanError("parallel.cp", f"parallel.cp={cp}: {family.model_type} cannot run with context parallelism "
                        f"in this version: {family.context_parallel}; use parallel.cp=1")
    seq = int(cfg.data.seq_len)
    if seq % (2 * cp):
        fits = [d for d in range(1, 65) if seq % (2 * d) == 0]
        raise PlanError("data.seq_len", f"data.seq_len={seq} must be divisible by 2 x parallel.cp = {2 * cp} "
                        f"(each row is cut into 2 x cp equal chunks, two per rank); use a multiple of {2 * cp}, "
                        f"or parallel.cp in {fits}")
    kernel = cfg.model.attn_implementation
    if kernel not in CP_KERNELS:
        raise PlanError("model.attn_implementation", f"model.attn_implementation={kernel} with parallel.cp={cp}: "
                        f"context parallelism runs with {list(CP_KERNELS)} in this version; use "
                        "model.attn_implementation=sdpa")
    installed = flash_attn_version() if kernel == "flash_attention_2" else None
    if installed is not None and installed < FLASH_BOTTOM_RIGHT:
        raise PlanError("model.attn_implementation", f"flash-attn {installed[0]}.{installed[1]} aligns the causal mask "
                        f"at the top left, which parallel.cp={cp} cannot use; install flash-attn >= 2.1 or use "
                        "model.attn_implementation=sdpa")
    if kernel == "eager" and getattr(hf_config, "reorder_and_upcast_attn", False):
        raise PlanError("model.config.reorder_and_upcast_attn", "GPT-2's reorder_and_upcast_attn bypasses "
                        f"transformers' attention functions, which parallel.cp={cp} wraps; set it to false or "
                        "use model.attn_implementation=sdpa")
    return cp


def check_recurrent_context_parallel(family: Any, cp: int, zero_stage: int) -> None:
    """A hybrid linear-attention model (Gated DeltaNet) at cp > 1 passes each block's recurrent state from cp
    rank to cp rank inside the block (:mod:`hybridtrain.parallel.state_pass`): a rank waits there for the rank
    before it. ZeRO-3 gathers a layer's parameters over the data axis (dp x cp) as each of its modules starts,
    so the first rank would wait in that gather for a rank that waits for its state: refused."""
    if cp > 1 and zero_stage == 3 and getattr(family, "linear_attention", None) is not None:
        raise PlanError("parallel.zero_stage", f"parallel.zero_stage=3 with parallel.cp={cp}: {family.model_type}'s "
                        "Gated DeltaNet blocks pass their recurrent state from cp rank to cp rank, one after the "
                        "other, while ZeRO-3 gathers each module's parameters over dp x cp as it starts; use "
                        "parallel.zero_stage=2 (or 1), or parallel.cp=1")
