"""Gradient norm and clipping for ZeRO-0 in fp32, where DeepSpeed gets the norm wrong.

With ZeRO 1-3 (and DeepSpeed's bf16 optimizer) DeepSpeed computes the global gradient norm
itself, counting a parameter replicated over TP on TP rank 0 only and a tied weight on one
pipeline stage only. With ZeRO-0 in fp32 it falls back to ``deepspeed.runtime.utils.clip_grad_norm_``,
which counts replicated parameters only on rank 0 of the *pipe x tensor* group (so the layer norms
and biases of every later stage are left out), counts a tied embedding twice, and does not keep the
norm (``engine.get_global_grad_norm()`` is ``None``). This module does the norm the ZeRO way,
clips with torch's ``clip_grads_with_norm_`` and records the norm on the engine.
"""
from __future__ import annotations

from typing import Any, Iterable


def global_grad_norm(params: Iterable[Any], tp_rank: int, group: Any, device: Any, expert_group: Any = None) -> Any:
    """The L2 norm of the gradients of the whole model (all stages, all TP shards, all experts) of one
    replica, on ``device`` (the engine's: the all-reduce runs there).

    ``group`` is the model-parallel group (pipe x tensor ranks of this data-parallel replica);
    ``expert_group`` the expert-parallel group (``parallel.ep`` > 1): its ranks hold different experts, so
    the squares of the expert gradients (``allreduce=False``) are summed over it first, once.
    """
    import torch

    from hybridtrain.parallel import collectives

    counted = [p for p in params
               if p.grad is not None and not getattr(p, "ds_pipe_replicated", False)  # tied copy: counted once
               and (tp_rank == 0 or getattr(p, "tensor_model_parallel", False))]  # replicated over TP: once

    def squares_of(grads: list) -> Any:
        # No gradient of its own (a TP rank > 0 of a stage holding only replicated or tied parameters):
        # torch's norm of an empty list is a CPU tensor, so start from a zero on the device instead.
        return (torch.nn.utils.get_total_norm(grads).double().square().to(device) if grads
                else torch.zeros((), dtype=torch.float64, device=device))

    experts = [p.grad for p in counted if getattr(p, "allreduce", True) is False]
    squares = squares_of([p.grad for p in counted if getattr(p, "allreduce", True) is not False])
    if expert_group is not None:
        squares = squares + collectives.all_reduce(squares_of(experts), device, group=expert_group)
    elif experts:
        squares = squares + squares_of(experts)
    if group is not None:
        squares = collectives.all_reduce(squares, device, group=group)
    return squares.sqrt().float()


def install_fp32_clipping(engine: Any, tp_rank: int, model_group: Any, max_norm: float, expert_group: Any = None) -> None:
    """Before each optimizer step: compute the global gradient norm, clip to ``max_norm`` (when
    > 0) and store the norm where ``engine.get_global_grad_norm()`` reads it.

    The DeepSpeed config of such a run sets ``gradient_clipping`` to 0 so that DeepSpeed does not
    clip a second time with its own norm (:func:`hybridtrain.engine.ds_config`). ``model_group``: the
    pipe x tensor ranks of this replica (:attr:`~hybridtrain.parallel.groups.ParallelGroups.model_group`);
    ``expert_group``: the expert-parallel group (``parallel.ep`` > 1), else ``None``.
    """
    import torch

    from hybridtrain.engine.memory import torch_optimizer

    def clip(*_):
        params = [p for p in engine.module.parameters() if p.grad is not None]
        norm = global_grad_norm(params, tp_rank, model_group, engine.device, expert_group)
        if max_norm > 0:  # torch's coefficient: max_norm / (norm + 1e-6), at most 1
            torch.nn.utils.clip_grads_with_norm_(params, max_norm, norm)
        engine._global_grad_norm = norm  # what get_global_grad_norm() returns (DeepSpeed leaves it None)

    torch_optimizer(engine.optimizer).register_step_pre_hook(clip)


def guard_empty_norm(optimizer: Any, device: Any) -> None:
    """Let DeepSpeed's BF16 optimizer (bf16 with ZeRO-1) run on a rank with no gradient to count.

    Its gradient norm stacks the norms of the gradients this rank counts (replicated ones on TP
    rank 0 only, a tied copy never); a TP rank > 0 of a pipeline stage that holds only replicated
    or tied parameters (``[final_norm, head]`` with a tied head) counts none, and ``torch.stack([])``
    raises before the model-parallel all-reduce its peers wait in (deepspeed 0.19.8,
    ``runtime/utils.py`` ``get_global_norm_of_tensors``). Such a rank now offers one zero on the
    device: the norm is unchanged and the all-reduce has every rank. A no-op for other optimizers.
    """
    import torch

    if type(optimizer).__name__ != "BF16_Optimizer":
        return
    counted = optimizer.get_grads_for_norm

    def get_grads_for_norm(for_clipping: bool = False):
        out = counted(for_clipping=for_clipping)
        if for_clipping or out[0]:
            return out
        return [torch.zeros(1, dtype=torch.float32, device=device)], out[1]

    optimizer.get_grads_for_norm = get_grads_for_norm
