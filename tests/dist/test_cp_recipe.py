"""The long-context recipe ``+recipe=llama_long`` (issue 31 point 7): its plan accepts ``parallel.cp=2`` within
the recipe's own ``plan.device_memory_gb`` and finds whole rows (cp=1) over it; the run itself (``slow``) trains
on 2 ranks in a few minutes on a CPU machine."""
from __future__ import annotations

import pytest
from helpers.config import compose
from helpers.launch import losses, metrics, run_cli

from hybridtrain.plan import Machine, rank_budget, resolve
from hybridtrain.plan.auto import estimate_layout
from hybridtrain.plan.calibrate import Rates
from hybridtrain.plan.report import build_report

CPU = Machine(gpus_per_node=0, fp16_supported=False, cpu_cores=2)
RATES = Rates(flops=1e10, latency=1e-4, bandwidth=1e9, device="cpu", threads=1, layer_overhead=5e-4)
OVER = "exceeds the budget"


def _planned(*overrides: str):
    cfg = compose("+recipe=llama_long", *overrides)
    plan, hf = resolve(cfg, CPU)
    budget = rank_budget(cfg, plan, CPU)
    return cfg, plan, hf, budget


def test_the_recipe_plans_cp2_within_its_budget():
    cfg, plan, hf, budget = _planned()
    assert (plan.dims.dp, plan.dims.cp, plan.dims.tp, plan.dims.pp) == (1, 2, 1, 1) and plan.world_size == 2
    assert budget == int(0.13 * 2**30) and not cfg.parallel.activation_checkpointing
    assert plan.tokens_per_step == 2 * 4096 and plan.grad_accum == 2
    assert estimate_layout(cfg, hf, CPU, RATES).memory <= budget  # auto's estimate, cp terms included


def test_whole_rows_are_over_the_same_budget():
    cfg, plan, hf, budget = _planned("parallel.cp=1")
    assert plan.dims.cp == 1 and plan.world_size == 1
    report = build_report(cfg, plan, hf, budget)
    assert max(st.memory.total for st in report.stages) > budget
    assert [w for w in report.warnings if OVER in w]
    assert estimate_layout(cfg, hf, CPU, RATES).memory > budget


def test_the_plan_report_sees_cp2_within_the_budget():
    cfg, plan, hf, budget = _planned()
    assert not [w for w in build_report(cfg, plan, hf, budget).warnings if OVER in w]


@pytest.mark.slow
def test_the_recipe_trains(tmp_path):
    """``python -m hybridtrain +recipe=llama_long`` as a new user runs it: 2 ranks, 6 steps, the loss falls."""
    run_cli(tmp_path, "+recipe=llama_long", timeout=900)
    loss = losses(tmp_path)
    assert len(loss) == 6 and loss[-1] < loss[0]
    assert metrics(tmp_path)[0]["loss_tokens"] == 2 * 4096
