"""Pipeline stage boundaries as a pure function of the layer list.

Boundaries use DeepSpeed's convention: ``parts[s]:parts[s+1]`` are the pipeline layers of stage
``s`` (``len(parts) == pp + 1``), so the result can be handed to ``PipelineModule`` as is.
"""
from __future__ import annotations

from typing import Callable, Optional, Sequence

from hybridtrain.models.units import Kind, kind_of

METHODS = ("balanced", "blocks", "uniform", "parameters")
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


def balanced(costs: Sequence[float], pp: int,
             fits: Optional[Callable[[int, int, int], bool]] = None) -> list[int]:
    """Contiguous split of ``costs`` into ``pp`` non-empty stages minimising the largest stage cost.

    Binary search on the bottleneck with a greedy feasibility check; ties go to the earliest cut.
    ``fits(stage, start, stop)`` is an extra constraint on each stage (memory): it must hold for
    single layers and get no harder for later stages or shorter ranges; if no split satisfies
    it, :class:`ValueError` is raised.
    """
    n = len(costs)
    if pp > n:
        raise ValueError(f"cannot split {n} layers into {pp} non-empty stages")
    ok = fits or (lambda _s, _a, _b: True)

    def cuts_for(limit: float) -> list[int] | None:  # greedy: fill each stage up to ``limit``
        bounds, acc = [0], 0.0
        for i, c in enumerate(costs):
            if i > bounds[-1] and (acc + c > limit or not ok(len(bounds) - 1, bounds[-1], i + 1)):
                bounds.append(i)
                acc = 0.0
            if i == bounds[-1] and not ok(len(bounds) - 1, i, i + 1):
                return None  # a layer that fits on no stage of its own
            acc += c
        bounds.append(n)
        return bounds if len(bounds) - 1 <= pp else None

    lo, hi = max(costs), float(sum(costs))
    if cuts_for(hi) is None:
        hi = float(sum(costs)) * (n + 1)  # memory forces more cuts than the cost alone would make
        if cuts_for(hi) is None:
            raise ValueError(f"no split of {n} layers into {pp} stages satisfies the memory limit")
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


def balanced_with_needs(costs: Sequence[float], pp: int, needed: Sequence[bool],
                        fits: Optional[Callable[[int, int, int], bool]] = None) -> list[int]:
    """:func:`balanced` where every stage must also hold one of the layers marked in ``needed`` (an MoE block
    when DeepSpeed's ZeRO-1 at ``parallel.ep`` > 1 needs one on every stage, :func:`~hybridtrain.plan.moe.expert_stage_needs`):
    the split of least bottleneck among those that satisfy it (and ``fits``), ties to the earliest cut. A
    dynamic programme over (stages, layers), ``O(pp n^2)``: the greedy of :func:`balanced` cannot see the
    constraint. :class:`ValueError` when no split satisfies it."""
    n = len(costs)
    ok = fits or (lambda _s, _a, _b: True)
    prefix, marks = [0.0], [0]
    for c, need in zip(costs, needed):
        prefix.append(prefix[-1] + c)
        marks.append(marks[-1] + bool(need))
    inf = float("inf")
    best = [[inf] * (n + 1) for _ in range(pp + 1)]  # best[s][i]: least bottleneck of layers [0, i) in s stages
    cut = [[-1] * (n + 1) for _ in range(pp + 1)]
    best[0][0] = 0.0
    for s in range(1, pp + 1):
        for i in range(s, n + 1):
            for j in range(s - 1, i):  # the last stage is [j, i)
                if best[s - 1][j] == inf or marks[i] == marks[j] or not ok(s - 1, j, i):
                    continue
                value = max(best[s - 1][j], prefix[i] - prefix[j])
                if value < best[s][i]:
                    best[s][i], cut[s][i] = value, j
    if best[pp][n] == inf:
        raise ValueError(f"no split of {n} layers into {pp} stages puts a required layer on every stage")
    bounds, i = [n], n
    for s in range(pp, 0, -1):
        i = cut[s][i]
        bounds.append(i)
    return bounds[::-1]


def manual(stage_layers: Sequence[int], n: int, pp: int) -> list[int]:
    """Stage boundaries from ``parallel.stage_layers`` (pipeline layers per stage); raises
    ``ValueError`` with the reason when they do not describe ``pp`` non-empty stages of ``n`` layers."""
    counts = list(stage_layers)
    if len(counts) != pp:
        raise ValueError(f"has {len(counts)} entries but parallel.pp={pp}; give one count per stage")
    if any(c < 1 for c in counts):
        raise ValueError(f"{counts} has an empty stage; every stage needs at least one layer")
    if sum(counts) != n:
        raise ValueError(f"{counts} sums to {sum(counts)} but the model has {n} pipeline layers")
    return bounds_from_counts(counts)


def partition(method: str, num_pre: int, num_blocks: int, num_post: int, pp: int,
              layer_params: Sequence[int] | None = None, layer_costs: Sequence[float] | None = None,
              fits: Optional[Callable[[int, int, int], bool]] = None, block_per_stage: bool = False,
              needs: Sequence[bool] | None = None) -> list[int]:
    """Stage boundaries for ``parallel.partition=method`` over ``num_pre + num_blocks + num_post`` layers.

    ``balanced`` needs ``layer_costs`` (time per layer, :func:`hybridtrain.plan.costs.layer_time_costs`)
    and takes the memory constraint ``fits`` (see :func:`balanced`), dropped when nothing satisfies it.
    ``block_per_stage`` (LoRA: only the blocks' adapters train, and a stage with nothing to train cannot
    run) keeps the final norm and head with the last block instead of letting them form a stage. ``needs``
    (one flag per pipeline layer, or ``None``): ``balanced`` puts a marked layer on every stage, a rule the plan
    checks after partitioning (:func:`~hybridtrain.plan.moe.check_expert_stages`), so it never refuses its own
    choice; where no split can satisfy it the unconstrained split is returned and the check names the fix.
    """
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
    if method == "balanced":
        if pp == 1:
            return [0, n]
        if layer_costs is None or len(layer_costs) != n:
            raise ValueError("partition 'balanced' needs one cost per pipeline layer")
        # Cut only between units that each hold a block, or the final norm with the head (see
        # :func:`stage_problem`): the embeddings ride with block 0, the norm with the head.
        starts = [0] + list(range(num_pre + 1, num_pre + num_blocks)) + ([] if block_per_stage else [n - num_post])
        ends = starts[1:] + [n]
        costs = [float(sum(layer_costs[a:b])) for a, b in zip(starts, ends)]
        unit_fits = None if fits is None else (lambda st, a, b: fits(st, starts[a], ends[b - 1]))
        needed = None if needs is None else [any(needs[a:b]) for a, b in zip(starts, ends)]
        merged = None
        if needed is not None and not all(needed) and sum(needed) >= pp:
            for constraint in ([unit_fits, None] if unit_fits is not None else [None]):
                try:
                    merged = balanced_with_needs(costs, pp, needed, constraint)  # over memory: the plan warns
                    break
                except ValueError:
                    continue
        if merged is None:
            try:
                merged = balanced(costs, pp, unit_fits)
            except ValueError:
                if fits is None:
                    raise
                merged = balanced(costs, pp)  # over memory anyway: the plan warns
        return [starts[i] for i in merged[:-1]] + [n]
    raise ValueError(f"parallel.partition={method!r} is not a method; use one of {list(METHODS)}")


def stage_problem(names: Sequence[str]) -> Optional[str]:
    """Why a stage of these pipeline layers cannot train under DeepSpeed, or ``None``.

    DeepSpeed's ZeRO optimizer computes the gradient norm with one model-parallel all-reduce per
    parameter group; hybridtrain has two groups (matrices with weight decay, biases and norms
    without), and an empty group is dropped. A stage whose layers lack one kind has one group
    fewer, so its collectives pair with the wrong ones and the job hangs. A decoder block has
    both kinds; embeddings and the head have only matrices, the final norm only vectors.
    """
    kinds = {kind_of(n) for n in names}
    if Kind.BLOCK in kinds or {Kind.FINAL_NORM, Kind.HEAD} <= kinds:
        return None
    return (f"a stage of only {', '.join(names)} has parameters of one kind (matrices or norms) and would "
            "hang DeepSpeed's gradient-norm collectives; every stage needs a decoder block, or the final "
            "norm together with the head")


MANUAL = "manual"
"""``plan.json``'s ``partition_method`` when ``parallel.stage_layers`` set the boundaries."""


def partition_advice(method: str, bounds: Sequence[int], measured: bool) -> str:
    """What to try when one stage is slower than the others, for a plan partitioned by ``method``
    (``plan.json``'s ``partition_method``) with stage boundaries ``bounds``: the one wording the plan report
    (``measured=False``: the planner's own cost estimate) and the run report (``True``: measured stage times)
    share."""
    counts = [b - a for a, b in zip(bounds, bounds[1:])]
    by_hand = "parallel.stage_layers" + (f" (now {counts})" if counts else "")
    if method == MANUAL:
        return f"change {by_hand} or try parallel.partition=balanced"
    if method == "balanced":
        if not measured:  # balanced already minimises the estimate: no contiguous split of it is more even
            return ("no contiguous split of these layers is more even by the estimate; fewer stages or more tp "
                    "shrink the largest layer")
        # the cost model misjudges these layers: the boundaries by hand come first
        return f"set the boundaries by hand with {by_hand} or try parallel.partition=blocks"
    return f"try parallel.partition=balanced or set the boundaries by hand with {by_hand}"
