"""Measure the model-state bytes a rank really holds: parameters, gradients, optimizer state.

DeepSpeed keeps most of a rank's model state outside ``module.parameters()``: flat fp32 master
partitions, flat gradient buffers, AdamW moments in the wrapped torch optimizer. There is no
DeepSpeed API that reports them, so the tensors are collected from the optimizer objects
themselves and counted once per storage (parameters are views into DeepSpeed's flat buffers,
gradients may alias a reduction bucket). The plan's memory estimate is checked against this.
"""
from __future__ import annotations

from typing import Any, Iterator

_MAX_DEPTH = 4


def _storage(t) -> tuple[int, int] | None:
    """``(data_ptr, nbytes)`` of ``t``'s storage; ``None`` for meta/empty tensors."""
    if t.device.type == "meta":
        return None
    s = t.untyped_storage()
    n = s.nbytes()
    return (s.data_ptr(), n) if n else None


def _tensors(obj: Any, path: str, depth: int, seen: set[int]) -> Iterator[tuple[str, Any]]:
    """``(attribute path, tensor)`` of every tensor reachable from ``obj`` through lists, tuples,
    dicts and optimizer-like objects (those with ``state`` or ``param_groups`` or a wrapped
    ``optimizer``), with each tensor's ``.grad``."""
    import torch

    if depth > _MAX_DEPTH or id(obj) in seen:
        return
    seen.add(id(obj))
    if isinstance(obj, torch.Tensor):
        yield path, obj
        if obj.grad is not None:
            yield path + ".grad", obj.grad
        return
    if isinstance(obj, dict):
        items = [(f"{path}[{k!r}]" if not isinstance(k, torch.Tensor) else path + "[param]", v) for k, v in obj.items()]
    elif isinstance(obj, (list, tuple)):
        items = [(f"{path}[{i}]", v) for i, v in enumerate(obj)]
    elif isinstance(obj, torch.optim.Optimizer) or hasattr(obj, "optimizer"):
        items = [(f"{path}.{k}", v) for k, v in vars(obj).items() if not isinstance(v, torch.nn.Module)]
    else:
        return
    for sub_path, value in items:
        yield from _tensors(value, sub_path, depth + 1, seen)


def model_state_bytes(module, optimizer) -> dict[str, int]:
    """Bytes this rank holds for ``params`` (the module's parameters and the flat buffers they
    live in), ``grads`` (their gradients and every DeepSpeed gradient buffer) and ``optim``
    (master copies and optimizer moments); ``total`` is the sum. Each storage counts once."""
    counted: dict[int, str] = {}
    sizes: dict[int, int] = {}

    def add(t, kind: str) -> None:
        st = _storage(t)
        if st is not None and st[0] not in counted:
            counted[st[0]], sizes[st[0]] = kind, st[1]

    params = list(module.parameters())
    for p in params:
        add(p, "params")
    for p in params:
        if p.grad is not None:
            add(p.grad, "grads")
    if optimizer is not None:
        for path, t in _tensors(optimizer, "optimizer", 0, set()):
            name = path.rsplit(".", 1)[-1]  # DeepSpeed's gradient buffers: *grad*, ipg_buffer (reduction bucket)
            add(t, "grads" if "grad" in name or "ipg" in name else "optim")
    out = {k: 0 for k in ("params", "grads", "optim")}
    for ptr, kind in counted.items():
        out[kind] += sizes[ptr]
    out["total"] = sum(out.values())
    return out


def torch_optimizer(optimizer):
    """The ``torch.optim.Optimizer`` inside DeepSpeed's wrappers (ZeRO, BF16), or ``optimizer`` itself."""
    import torch

    while not isinstance(optimizer, torch.optim.Optimizer) and hasattr(optimizer, "optimizer"):
        optimizer = optimizer.optimizer
    return optimizer
