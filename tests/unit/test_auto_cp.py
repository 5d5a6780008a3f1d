"""``parallel=auto`` and context parallelism (``parallel.cp``, issue 31 point 5): every cp the sequence allows is
scored, every cp layout goes through ``build_plan``; auto picks cp where no layout of whole rows fits, or where
whole rows fit only with activation checkpointing, and keeps whole rows at a short sequence. No processes."""
from __future__ import annotations

import pytest
from helpers.config import cfg_of

from hybridtrain.plan import Machine, build_plan, model_config
from hybridtrain.plan.auto import apply, candidates, context_degrees, estimate_layout, search
from hybridtrain.plan.calibrate import Rates

CPU = Machine(gpus_per_node=0, fp16_supported=False, cpu_cores=2)
RATES = Rates(flops=1e10, latency=1e-4, bandwidth=1e9, device="cpu", threads=1, layer_overhead=5e-4)
# llama_long with one KV head: tp=1 only, so at 4096 tokens the 125 MiB of fp32 logits of whole rows
# (4 x 4096 x 8000 bytes) sit on some rank of every dp / pp layout of 2 ranks, checkpointing or not.
LONG = ("+recipe=llama_long", "model.config.num_key_value_heads=1", "parallel=auto", "plan.world_size=2",
        "plan.device_memory_gb=0.13")


def test_cp_degrees_divide_the_world_and_two_chunks_per_rank():
    assert context_degrees(4096, 8) == [1, 2, 4, 8]
    assert context_degrees(36, 8) == [1, 2]  # 36 % 8 != 0: cp=4 would cut uneven chunks
    assert context_degrees(7, 4) == [1]
    cfg = cfg_of("+recipe=llama_tiny")
    layouts = {(c.dp, c.cp, c.tp, c.pp) for c in candidates(cfg, 4, [1, 2, 4])}
    assert all(dp * cp * tp * pp == 4 for dp, cp, tp, pp in layouts)
    assert {(2, 2, 1, 1), (1, 2, 2, 1), (1, 4, 1, 1), (1, 2, 1, 2)} <= layouts


def test_auto_picks_cp_where_whole_rows_do_not_fit():
    cfg = cfg_of(*LONG)
    hf = model_config(cfg)
    choice = search(cfg, hf, CPU, RATES)
    best = choice.best
    assert best.cp == 2 and best.dp * best.cp * best.tp * best.pp == 2
    assert best.memory <= choice.device_memory
    assert all(c.cp > 1 for c in choice.ranked)  # nothing of whole rows fits
    text = choice.explain(3)
    assert "chose dp=1 cp=2 tp=1 pp=1" in text and "cp_comm per micro-batch" in text
    apply(cfg, best)  # the pick is a plan the rules accept, with cp in it
    plan = build_plan(cfg, hf, CPU, int(hf.vocab_size))
    assert (plan.dims.dp, plan.dims.cp, plan.dims.tp, plan.dims.pp) == (best.dp, best.cp, best.tp, best.pp)
    assert plan.dims.world == 2 and plan.dims.data == 2


def test_auto_keeps_whole_rows_at_a_short_sequence():
    cfg = cfg_of("+recipe=llama_long", "data.seq_len=256", "parallel=auto", "plan.world_size=2",
                 "plan.device_memory_gb=0.13")
    choice = search(cfg, model_config(cfg), CPU, RATES)
    assert choice.best.cp == 1 and "cp=" not in choice.explain(0)
    cp = [c for c in choice.ranked if c.cp > 1]  # scored, and slower: the same compute plus the gathers
    assert cp and min(c.step_time for c in cp) > choice.best.step_time


def test_auto_picks_cp_over_whole_rows_that_fit_only_with_checkpointing():
    """On a budget where whole rows of 4096 tokens fit dp = 2 only with activation checkpointing (0.16 GiB), cp = 2
    without it is faster by the cost model (no recomputed forward; the gathers cost less) and auto picks it."""
    cfg = cfg_of(*LONG[:-1], "plan.device_memory_gb=0.16")
    choice = search(cfg, model_config(cfg), CPU, RATES)
    whole = [c for c in choice.ranked if c.cp == 1]
    fastest_whole = min(whole, key=lambda c: c.step_time)  # dp = 2 with checkpointing (pp = 2 without: a bubble)
    assert fastest_whole.activation_checkpointing and fastest_whole.dp == 2
    best = choice.best
    assert best.cp == 2 and not best.activation_checkpointing and best.memory <= choice.device_memory
    assert best.step_time < min(c.step_time for c in whole)


def test_a_cp_layout_divides_the_rank_compute_and_its_memory():
    """The same rows at cp=2 against cp=1: about half the compute per rank, the logits halved, and a
    communication term that is the keys' and values' all-gather and reduce-scatter."""
    one = cfg_of("+recipe=llama_long", "parallel.cp=1")
    two = cfg_of("+recipe=llama_long")
    a, b = estimate_layout(one, model_config(one), CPU, RATES), estimate_layout(two, model_config(two), CPU, RATES)
    key = "compute+comm per micro-batch (slowest stage)"
    comm = b.parts["cp_comm per micro-batch"]
    assert comm > 0 and "cp_comm per micro-batch" not in a.parts
    assert b.parts[key] - comm == pytest.approx(a.parts[key] / 2, rel=0.05)
    gib = 2**30
    assert a.memory > 0.13 * gib > b.memory  # the recipe's arithmetic: cp=1 over its budget, cp=2 within
