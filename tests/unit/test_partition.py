"""Pipeline stage boundaries (``hybridtrain.plan.partition``): pure functions, checked against
hand-worked cases and, for the balanced split, against brute force over every cut."""
from __future__ import annotations

import itertools
import random

import pytest

from hybridtrain.plan.partition import (
    METHODS,
    balanced,
    bounds_from_counts,
    by_blocks,
    even_counts,
    partition,
)


def stage_costs(costs, bounds):
    return [sum(costs[a:b]) for a, b in zip(bounds, bounds[1:])]


def assert_valid_bounds(bounds, n, pp):
    """DeepSpeed's ``parts``: pp + 1 increasing boundaries from 0 to n, no empty stage."""
    assert len(bounds) == pp + 1, bounds
    assert bounds[0] == 0 and bounds[-1] == n, bounds
    assert all(a < b for a, b in zip(bounds, bounds[1:])), f"empty stage in {bounds}"


def brute_force_bottleneck(costs, pp):
    """The smallest possible largest-stage cost over every way to cut ``costs`` into ``pp`` stages."""
    n = len(costs)
    return min(max(stage_costs(costs, [0, *cuts, n])) for cuts in itertools.combinations(range(1, n), pp - 1))


# --- even_counts / bounds_from_counts / by_blocks ------------------------------------------------

@pytest.mark.parametrize("n, parts, expected", [
    (8, 2, [4, 4]), (10, 3, [3, 3, 4]), (7, 2, [3, 4]), (11, 4, [2, 3, 3, 3]), (5, 1, [5]), (3, 3, [1, 1, 1]),
])
def test_even_counts(n, parts, expected):
    assert even_counts(n, parts) == expected


def test_even_counts_properties():
    for n in range(1, 30):
        for parts in range(1, n + 1):
            counts = even_counts(n, parts)
            assert sum(counts) == n and len(counts) == parts
            assert max(counts) - min(counts) <= 1
            assert counts == sorted(counts)  # larger bins last: stage 0 keeps the least


def test_bounds_from_counts():
    assert bounds_from_counts([2, 3, 1]) == [0, 2, 5, 6]
    assert bounds_from_counts([]) == [0]


@pytest.mark.parametrize("pre, blocks, post, pp, expected", [
    (2, 4, 2, 1, [0, 8]),
    (2, 4, 2, 2, [0, 4, 8]),            # gpt_tiny: embed + pos_embed + 2 blocks | 2 blocks + norm + head
    (1, 4, 2, 3, [0, 2, 3, 7]),         # llama_tiny: the extra block goes to the last stage
    (1, 32, 2, 4, [0, 9, 17, 25, 35]),  # llama_7b: 8 blocks per stage
])
def test_by_blocks(pre, blocks, post, pp, expected):
    assert by_blocks(pre, blocks, post, pp) == expected


def test_by_blocks_puts_embeddings_first_and_head_last():
    for pp in range(1, 7):
        bounds = by_blocks(2, 12, 2, pp)
        assert_valid_bounds(bounds, 16, pp)
        blocks_per_stage = [b - a for a, b in zip(bounds, bounds[1:])]
        blocks_per_stage[0] -= 2
        blocks_per_stage[-1] -= 2
        assert blocks_per_stage == even_counts(12, pp)


# --- balanced ------------------------------------------------------------------------------------

def test_balanced_matches_brute_force_on_integers():
    rng = random.Random(1234)
    for _ in range(300):
        n = rng.randint(1, 9)
        pp = rng.randint(1, n)
        costs = [rng.randint(1, 50) for _ in range(n)]
        bounds = balanced(costs, pp)
        assert_valid_bounds(bounds, n, pp)
        assert max(stage_costs(costs, bounds)) == brute_force_bottleneck(costs, pp), (costs, pp, bounds)


def test_balanced_matches_brute_force_on_parameter_counts():
    # realistic magnitudes (embedding ~1e7, blocks ~1e6): the float bisection must still be exact
    rng = random.Random(99)
    for _ in range(100):
        n = rng.randint(2, 10)
        pp = rng.randint(1, n)
        costs = [float(rng.randint(10**5, 3 * 10**7)) for _ in range(n)]
        bounds = balanced(costs, pp)
        assert_valid_bounds(bounds, n, pp)
        assert max(stage_costs(costs, bounds)) == pytest.approx(brute_force_bottleneck(costs, pp), rel=1e-12)


def test_balanced_hand_cases():
    assert balanced([1, 1, 1, 1], 2) == [0, 2, 4]
    assert balanced([10, 1, 1, 1, 1, 10], 2) == [0, 3, 6]
    assert balanced([5, 1, 1, 1], 2) == [0, 1, 4]
    assert balanced([3, 3, 3], 3) == [0, 1, 2, 3]
    assert balanced([7], 1) == [0, 1]


def test_balanced_uses_every_stage_even_when_fewer_would_do():
    # one huge layer: two stages already reach the bottleneck, yet pp=4 non-empty stages come back
    costs = [100, 1, 1, 1, 1]
    bounds = balanced(costs, 4)
    assert_valid_bounds(bounds, 5, 4)
    assert max(stage_costs(costs, bounds)) == 100


def test_balanced_rejects_more_stages_than_layers():
    with pytest.raises(ValueError, match="cannot split 3 layers into 4"):
        balanced([1, 2, 3], 4)


# --- partition -----------------------------------------------------------------------------------

def test_methods():
    assert METHODS == ("balanced", "blocks", "uniform", "parameters")


def test_partition_blocks():
    assert partition("blocks", 2, 4, 2, 2) == by_blocks(2, 4, 2, 2) == [0, 4, 8]


def test_partition_uniform_counts_every_layer_once():
    # 1 + 6 + 2 = 9 pipeline layers over 2 stages: 4 | 5, embedding and blocks alike
    assert partition("uniform", 1, 6, 2, 2) == [0, 4, 9]
    assert partition("uniform", 2, 4, 2, 3) == bounds_from_counts(even_counts(8, 3))


def test_partition_parameters_balances_counts():
    params = [4000, 1000, 1000, 1000, 1000, 10, 4000]  # embed, 4 blocks, norm, untied head
    bounds = partition("parameters", 1, 4, 2, 2, params)
    assert bounds == balanced([float(p) for p in params], 2)
    assert max(stage_costs(params, bounds)) == brute_force_bottleneck(params, 2)


@pytest.mark.parametrize("params", [None, [1, 2, 3]])
def test_partition_parameters_needs_one_count_per_layer(params):
    with pytest.raises(ValueError, match="one parameter count per pipeline layer"):
        partition("parameters", 1, 4, 2, 2, params)


def test_partition_unknown_method():
    with pytest.raises(ValueError) as info:
        partition("random", 1, 4, 2, 2)
    assert "parallel.partition='random'" in str(info.value)
    assert "['balanced', 'blocks', 'uniform', 'parameters']" in str(info.value)


@pytest.mark.parametrize("method", METHODS)
def test_partition_rejects_more_stages_than_layers(method):
    # 1 + 2 + 2 = 5 pipeline layers cannot fill 6 non-empty stages
    with pytest.raises(ValueError):
        partition(method, 1, 2, 2, 6, [1] * 5, [1.0] * 5)


@pytest.mark.parametrize("method", METHODS)
def test_partition_never_returns_an_empty_stage(method):
    """Either valid DeepSpeed boundaries with every stage non-empty, or a ValueError."""
    pre, blocks, post = 1, 2, 2
    n = pre + blocks + post
    for pp in range(1, n + 1):
        try:
            bounds = partition(method, pre, blocks, post, pp, [1] * n, [1.0] * n)
        except ValueError:
            continue
        assert_valid_bounds(bounds, n, pp)


def test_partition_balanced_uses_the_costs():
    costs = [1.0, 1.0, 1.0, 1.0, 1.0, 5.0]  # a heavy head: only the final norm stays with it
    assert partition("balanced", 1, 3, 2, 2, None, costs) == [0, 4, 6]  # never the head alone
    assert partition("balanced", 2, 4, 2, 3, None, [1.0] * 8) == [0, 3, 6, 8]  # never embeddings alone
    assert partition("balanced", 1, 3, 2, 1, None, None) == [0, 6]  # one stage needs no costs
    with pytest.raises(ValueError, match="one cost per pipeline layer"):
        partition("balanced", 1, 3, 2, 2, None, costs[:-1])


def _brute_needs(costs, pp, needed):
    """The least bottleneck of every contiguous split whose stages each hold a marked layer (None: no such split)."""
    import itertools

    n, best = len(costs), None
    for cuts in itertools.combinations(range(1, n), pp - 1):
        b = [0, *cuts, n]
        if all(any(needed[b[s]:b[s + 1]]) for s in range(pp)):
            value = max(sum(costs[b[s]:b[s + 1]]) for s in range(pp))
            best = value if best is None else min(best, value)
    return best


def test_balanced_with_needs_is_the_best_split_that_meets_the_rule():
    """Against brute force on 400 random cases: the constrained split's bottleneck is the least among the splits
    with a marked layer on every stage, it meets the rule, and ValueError exactly when none exists."""
    import random

    from hybridtrain.plan.partition import balanced_with_needs

    rng = random.Random(0)
    for _ in range(400):
        n = rng.randint(2, 9)
        pp = rng.randint(2, min(4, n))
        costs = [rng.randint(1, 9) for _ in range(n)]
        needed = [rng.random() < 0.4 for _ in range(n)]
        want = _brute_needs(costs, pp, needed)
        if want is None:
            with pytest.raises(ValueError, match="puts a required layer on every stage"):
                balanced_with_needs(costs, pp, needed)
            continue
        b = balanced_with_needs(costs, pp, needed)
        assert b[0] == 0 and b[-1] == n and len(b) == pp + 1
        assert all(any(needed[b[s]:b[s + 1]]) for s in range(pp)), (costs, needed, b)
        assert max(sum(costs[b[s]:b[s + 1]]) for s in range(pp)) == want


def test_partition_balanced_honours_needs_and_ignores_an_impossible_rule():
    """``partition(..., needs=)``: the head's cost would take a stage of its own; with the blocks marked it joins
    the last block. With fewer marked units than stages the unconstrained split comes back (the plan's check then
    names the fix)."""
    costs = [1.0, 1.0, 1.0, 1.0, 1.0, 0.0, 9.0]  # embed, 4 blocks, final norm, head
    free = partition("balanced", 1, 4, 2, 2, layer_costs=costs)
    assert free == [0, 5, 7]  # stage 1 holds only the final norm and the head
    needs = [False, True, True, True, True, False, False]
    assert partition("balanced", 1, 4, 2, 2, layer_costs=costs, needs=needs) == [0, 4, 7]
    only_one = [False, True, False, False, False, False, False]
    assert partition("balanced", 1, 4, 2, 2, layer_costs=costs, needs=only_one) == free
