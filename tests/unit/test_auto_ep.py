"""``parallel=auto`` and expert parallelism (``parallel.ep``, issue 30 point 7): for an MoE model every ep that
divides the experts (and dp) is scored through the plan's own rules, with the dispatch's all-to-alls in the step
time and the experts' memory and gradient reduction split over ep; a dense model gets ep = 1 only. No processes."""
from __future__ import annotations

from helpers.config import cfg_of
from unit.test_moe_plan import TINY_MOE

from hybridtrain.models.families import family_of
from hybridtrain.plan import Machine, build_plan, model_config
from hybridtrain.plan.auto import apply, candidates, estimate_layout, expert_degrees, search
from hybridtrain.plan.calibrate import Rates

CPU = Machine(gpus_per_node=0, fp16_supported=False, cpu_cores=4)
RATES = Rates(flops=1e10, latency=1e-4, bandwidth=1e9, device="cpu", threads=1, layer_overhead=5e-4)
# One KV head (tp = 1 only) and 16 wide experts: the experts are most of a rank's memory.
WIDE = (*TINY_MOE, "model.config.num_key_value_heads=1", "model.config.num_experts=16",
        "model.config.moe_intermediate_size=256", "plan.world_size=4")


def test_ep_degrees_divide_the_world_and_the_experts():
    moe = cfg_of(*TINY_MOE)
    assert expert_degrees(family_of(moe.model), model_config(moe), 4) == [1, 2, 4]
    six = cfg_of(*TINY_MOE, "model.config.num_experts=6")
    assert expert_degrees(family_of(six.model), model_config(six), 4) == [1, 2]
    dense = cfg_of("+recipe=llama_tiny")
    assert expert_degrees(family_of(dense.model), model_config(dense), 4) == [1]
    layouts = {(c.dp, c.ep) for c in candidates(moe, 4, [1], [1, 2, 4])}
    assert all(dp % ep == 0 for dp, ep in layouts) and {(4, 4), (2, 2), (4, 2), (1, 1)} <= layouts


def test_auto_scores_ep_and_picks_it_where_the_experts_dominate():
    cfg = cfg_of(*WIDE, "parallel=auto", "plan.device_memory_gb=0.03")
    hf = model_config(cfg)
    choice = search(cfg, hf, CPU, RATES)
    best = choice.best
    assert best.ep > 1 and best.dp % best.ep == 0 and best.memory <= choice.device_memory
    assert {c.ep for c in choice.ranked} >= {1, 2, 4}
    assert f"ep={best.ep}" in choice.explain(0) and "ep_comm per micro-batch" in choice.explain(0)
    apply(cfg, best)  # the pick is a plan the rules accept, with ep in it
    plan = build_plan(cfg, hf, CPU, int(hf.vocab_size))
    assert (plan.dims.dp, plan.dims.ep, plan.dims.tp, plan.dims.pp) == (best.dp, best.ep, best.tp, best.pp)


def test_a_dense_model_is_searched_without_ep():
    cfg = cfg_of("+recipe=llama_tiny", "parallel=auto", "plan.world_size=4")
    choice = search(cfg, model_config(cfg), CPU, RATES)
    assert {c.ep for c in choice.ranked} == {1} and "ep=" not in choice.explain(5)


def test_ep_splits_the_experts_memory_and_adds_the_dispatch_all_to_alls():
    """dp = 4 at ep = 1, 2, 4 (ZeRO-0): each rank holds E / ep experts, so memory falls with ep; the dispatch
    term is there only at ep > 1 and grows with top-k (each token goes to k experts)."""
    est = {}
    for ep in (1, 2, 4):
        for k in (1, 2):
            cfg = cfg_of(*WIDE, "parallel.dp=4", f"parallel.ep={ep}", "parallel.zero_stage=0",
                         f"model.config.num_experts_per_tok={k}")
            est[ep, k] = estimate_layout(cfg, model_config(cfg), CPU, RATES)
    assert est[1, 2].memory > est[2, 2].memory > est[4, 2].memory
    assert "ep_comm per micro-batch" not in est[1, 2].parts
    assert 0 < est[2, 1].parts["ep_comm per micro-batch"] < est[2, 2].parts["ep_comm per micro-batch"]
