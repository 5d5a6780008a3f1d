"""Pipeline stage boundaries as a pure function of the layer list.

Boundaries use DeepSpeed's convention: ``parts[s]:parts[s+1]`` are the pipeline layers of stage
``s`` (``len(parts) == pp + 1``), so the result can be handed to ``PipelineModule`` as is.
"""
from __future__ import annotations

from typing import Sequence

METHODS = ("blocks", "uniform", "parameters")
"""Values of ``parallel.partition``."""


def even_counts(n: int, parts: int) -> list[int]:
    """``n`` items over ``parts`` bins, sizes differing by at most one, larger bins last.

    The last stages also hold the final norm, head and loss, but the first stage holds the
    embedding and in 1F1B keeps the most micro-batches in flight; extra blocks go to the end so
    that stage 0's activation memory stays lowest.
    """
    base, extra = divmod(n, parts)
    return [base + (1 if i >= parts - extra else 0) for i in range(parts)]


def bounds_from_counts(counts: Sequence[int]) -> list[int]:
    """``[0, c0, c0+c1, ...]``."""
    out = [0]
    for c in counts:
        out.append(out[-1] + c)
    return out


def by_blocks(num_pre: int, num_blocks: int, num_post: int, pp: int) -> list[int]:
    """Decoder blocks spread evenly; the ``num_pre`` layers (embeddings) join stage 0 and the
    ``num_post`` layers (final norm, head) join the last stage."""
    counts = even_counts(num_blocks, pp)
    counts[0] += num_pre
    counts[-1] += num_post
    return bounds_from_counts(counts)


def balanced(costs: Sequence[float], pp: int) -> list[int]:
    """Contiguous split of ``costs`` into ``pp`` non-empty stages minimising the largest stage cost.

    Binary search on the bottleneck with a greedy feasibility check; ties go to the earliest cut.
    """
    n = len(costs)
    if pp > n:
        raise ValueError(f"cannot split {n} layers into {pp} non-empty stages")

    def cuts_for(limit: float) -> list[int] | None:  # greedy: fill each stage up to ``limit``
        bounds, acc = [0], 0.0
        for i, c in enumerate(costs):
            if acc + c > limit and i > bounds[-1]:
                bounds.append(i)
                acc = 0.0
            acc += c
        bounds.append(n)
        return bounds if len(bounds) - 1 <= pp else None

    lo, hi = max(costs), float(sum(costs))
    for _ in range(60):
        mid = (lo + hi) / 2
        if cuts_for(mid) is None:
            lo = mid
        else:
            hi = mid
    bounds = cuts_for(hi)
    assert bounds is not None
    while len(bounds) - 1 < pp:  # fewer stages used than asked: split the largest multi-layer stage
        sizes = [(bounds[s + 1] - bounds[s], s) for s in range(len(bounds) - 1)]
        _, s = max(sizes)
        bounds.insert(s + 1, (bounds[s] + bounds[s + 1]) // 2)
    return bounds


def partition(method: str, num_pre: int, num_blocks: int, num_post: int, pp: int,
              layer_params: Sequence[int] | None = None) -> list[int]:
    """Stage boundaries for ``parallel.partition=method`` over ``num_pre + num_blocks + num_post`` layers."""
    n = num_pre + num_blocks + num_post
    if method in ("blocks", "uniform"):
        items = num_blocks if method == "blocks" else n
        if pp > items:
            raise ValueError(f"partition {method!r} cannot fill {pp} stages with {items} "
                             f"{'blocks' if method == 'blocks' else 'layers'}")
    if method == "blocks":
        return by_blocks(num_pre, num_blocks, num_post, pp)
    if method == "uniform":
        return bounds_from_counts(even_counts(n, pp))
    if method == "parameters":
        if layer_params is None or len(layer_params) != n:
            raise ValueError("partition 'parameters' needs one parameter count per pipeline layer")
        return balanced([float(p) for p in layer_params], pp)
    raise ValueError(f"parallel.partition={method!r} is not a method; use one of {list(METHODS)}")
