"""Planning without processes: the plan command's numbers, the cost-balanced partition, manual
stage boundaries, the memory model's formulas, ``parallel=auto``'s search and ``verify``'s twin.

The memory estimate against real allocations, the balanced partition's measured effect and the
search against measured tokens/s are checked with real runs (``tests/dist/test_planning_runs.py``,
``bench/bench_partition.py``, ``bench/bench_auto.py``)."""
from __future__ import annotations

import itertools

import pytest
from helpers.config import LLAMA_70B, cfg_of

from hybridtrain.models.families import get_family
from hybridtrain.plan import Machine, PlanError, model_config, resolve
from hybridtrain.plan.calibrate import Rates
from hybridtrain.plan.costs import layer_time_costs, model_facts
from hybridtrain.plan.memory import GiB, model_state
from hybridtrain.plan.partition import balanced, partition, stage_problem
from hybridtrain.plan.report import build_report, format_report

CPU = Machine(gpus_per_node=0, fp16_supported=False, cpu_cores=4)
RATES = Rates(flops=1e10, latency=1e-4, bandwidth=1e9, device="cpu", threads=1, layer_overhead=5e-4)
"""Fixed machine rates: the search is a pure function of them (no probe in unit tests)."""


def stage_costs(costs, bounds):
    return [sum(costs[a:b]) for a, b in zip(bounds, bounds[1:])]


# --- balanced partition --------------------------------------------------------------------------

def test_balanced_is_the_default_and_minimises_the_slowest_stage():
    cfg = cfg_of("+recipe=gpt_tiny", "parallel.pp=3")
    assert cfg.parallel.partition == "balanced"
    plan, hf = resolve(cfg, CPU)
    facts = model_facts(get_family("gpt2"), hf, plan.seq_len, plan.dims.tp)
    costs = layer_time_costs(facts, plan.micro_batch_size, plan.dims)
    n = len(costs)
    valid = [[0, *cuts, n] for cuts in itertools.combinations(range(1, n), 2)
             if all(stage_problem(plan.layer_names[a:b]) is None for a, b in zip([0, *cuts], [*cuts, n]))]
    best = min(max(stage_costs(costs, bounds)) for bounds in valid)
    assert plan.stage_bounds in valid
    assert max(stage_costs(costs, plan.stage_bounds)) == pytest.approx(best, rel=1e-9)
    # the 8000 x 96 head outweighs the 96-wide blocks: uniform splitting is worse here
    uniform = partition("uniform", 2, 4, 2, 3)
    assert max(stage_costs(costs, uniform)) > 1.1 * best


@pytest.mark.parametrize("names, ok", [
    (["embed", "pos_embed"], False), (["head"], False), (["final_norm"], False), (["embed", "block.0"], True),
    (["final_norm", "head"], True), (["block.3", "final_norm", "head"], True),
])
def test_stage_problem_every_stage_needs_both_parameter_groups(names, ok):
    assert (stage_problem(names) is None) == ok


def test_a_stage_deepspeed_would_hang_on_is_a_plan_error():
    # DeepSpeed's norm collectives pair one per parameter group: a head-only stage has one group
    cfg = cfg_of("+recipe=gpt_tiny", "parallel.pp=2", "parallel.stage_layers=[7,1]")
    with pytest.raises(PlanError) as info:
        resolve(cfg, CPU)
    assert info.value.key == "parallel.stage_layers" and "stage 1: a stage of only head" in str(info.value)
    cfg = cfg_of("+recipe=gpt_tiny", "parallel.pp=4", "parallel.partition=uniform")  # [embed, pos_embed] alone
    with pytest.raises(PlanError) as info:
        resolve(cfg, CPU)
    assert info.value.key == "parallel.partition" and "hang" in str(info.value)


def test_tied_head_counted_once_and_costs_cover_head_and_loss():
    cfg = cfg_of("+recipe=llama_tiny")  # tied embeddings
    _, hf = resolve(cfg, CPU)
    facts = model_facts(get_family("llama"), hf, 32, 1)
    head = facts.units[-1]
    assert head.tied and head.flops > 0 and head.elementwise >= 4 * facts.padded_vocab
    embed_params = facts.units[0].params(1)
    assert facts.total_params() == sum(u.params(1) for u in facts.units) - embed_params


def test_balanced_respects_the_memory_constraint():
    costs = [1.0, 1.0, 1.0, 10.0]
    memory = [5.0, 5.0, 5.0, 1.0]
    unconstrained = balanced(costs, 2)
    assert unconstrained == [0, 3, 4]  # 15 bytes on stage 0

    def fits(stage, a, b):
        return sum(memory[a:b]) <= 10.0

    assert balanced(costs, 2, fits) == [0, 2, 4]  # memory forces one layer over
    with pytest.raises(ValueError, match="memory"):
        balanced(costs, 2, lambda s, a, b: sum(memory[a:b]) <= 4.0)


def test_manual_stage_layers():
    cfg = cfg_of("+recipe=gpt_tiny", "parallel.pp=2", "parallel.stage_layers=[5,3]")
    plan, _ = resolve(cfg, CPU)
    assert plan.stage_bounds == [0, 5, 8]
    assert plan.stage_layers(1) == ["block.3", "final_norm", "head"]


@pytest.mark.parametrize("layers, fragment", [
    ("[8]", "has 1 entries but parallel.pp=2"),
    ("[8,0]", "empty stage"),
    ("[4,3]", "sums to 7 but the model has 8 pipeline layers"),
])
def test_manual_stage_layers_errors(layers, fragment):
    cfg = cfg_of("+recipe=gpt_tiny", "parallel.pp=2", f"parallel.stage_layers={layers}")
    with pytest.raises(PlanError) as info:
        resolve(cfg, CPU)
    assert info.value.key == "parallel.stage_layers" and fragment in str(info.value)
    assert "embed, ..., head (8 in all)" in str(info.value)


def test_partition_change_is_a_layout_change_for_checkpoints():
    a, _ = resolve(cfg_of("+recipe=gpt_tiny", "parallel.pp=2"), CPU)
    b, _ = resolve(cfg_of("+recipe=gpt_tiny", "parallel.pp=2", "parallel.partition=blocks"), CPU)
    assert a.stage_bounds != b.stage_bounds and a.layout() != b.layout()
    one, _ = resolve(cfg_of("+recipe=gpt_tiny"), CPU)
    assert "stage_bounds" not in one.layout()  # pp = 1: nothing to match


# --- the plan report -----------------------------------------------------------------------------

@pytest.mark.parametrize("dp, tp, pp", [(2, 2, 2), (1, 2, 3), (3, 1, 2), (2, 3, 1)])
def test_rank_map_is_deepspeeds_topology(dp, tp, pp):
    from deepspeed.runtime.pipe.topology import PipeModelDataParallelTopology

    cfg = cfg_of("+recipe=gpt_tiny", f"parallel.dp={dp}", f"parallel.tp={tp}", f"parallel.pp={pp}",
                 "trainer.global_batch_size=12")
    plan, hf = resolve(cfg, CPU)
    topo = PipeModelDataParallelTopology(num_pp=pp, num_mp=tp, num_dp=dp)
    for row in build_report(cfg, plan, hf, 0).rank_map():
        coord = topo.get_coord(row["rank"])
        assert (row["pp"], row["dp"], row["tp"]) == (coord.pipe, coord.data, coord.model)


def test_model_state_formulas():
    sizes = [1000, 10]  # elements; ZeRO pads the flat buffer to a multiple of dp
    n = 1010
    assert model_state(sizes, 0, 2, "fp32") == (4 * n, 4 * n, 8 * n)
    assert model_state(sizes, 1, 1, "fp32") == (4 * n, 8 * n, 12 * n)
    assert model_state(sizes, 1, 2, "fp32") == (4 * n, 8 * 505, 12 * 505)
    assert model_state(sizes, 1, 4, "fp32") == (4 * n, 4 * n, 12 * 253)  # full gradients after the backward
    assert model_state(sizes, 1, 2, "fp16") == (2 * n, 6 * 505, 12 * 505)
    # bf16: gradients accumulate in fp32 through DeepSpeed's BF16 optimizer (bf16 grads + a full fp32 buffer)
    assert model_state(sizes, 1, 2, "bf16") == (2 * n, 6 * n, 12 * 505)
    bucket = 4 * 500_000_000  # ZeRO-2/3's reduction bucket, allocated whole
    assert model_state(sizes, 2, 2, "fp32") == (4 * n, bucket + 4 * 505, 12 * 505)
    assert model_state(sizes, 3, 2, "fp32") == (4 * n, bucket + 4 * 505, 16 * 505)  # gathered params stay live


def test_report_numbers_and_warnings():
    cfg = cfg_of("+recipe=gpt_tiny", "parallel.pp=2", "parallel.partition=uniform", "plan.device_memory_gb=0.001")
    plan, hf = resolve(cfg, CPU)
    report = build_report(cfg, plan, hf, int(0.001 * GiB))
    assert report.bubble == pytest.approx((2 - 1) / (12 + 2 - 1))
    text = format_report(report)
    assert "tokens per step 384" in text and "(2-1)/(12+2-1) = 7.7%" in text
    assert any("stage imbalance" in w and "parallel.partition=balanced" in w for w in report.warnings)
    assert any("exceeds the budget of" in w for w in report.warnings)
    # the first stage keeps pp - s = 2 micro-batches in flight, the last one
    assert report.stages[0].memory.activations > 0 and "in-flight" in text
    assert sum(st.params for st in report.stages) >= report.facts.total_params()






# --- parallel=auto -------------------------------------------------------------------------------

def _search(*overrides: str):
    from hybridtrain.plan.auto import search

    cfg = cfg_of(*overrides)
    hf = model_config(cfg)  # what resolve does before searching (attention kernel, vocabulary)
    return cfg, search(cfg, hf, CPU, RATES)


def test_auto_enumerates_valid_layouts_and_picks_the_fastest_that_fits():
    cfg, choice = _search("+recipe=gpt_tiny", "parallel=auto", "plan.world_size=4", "model.config.n_head=4")
    layouts = {(c.dp, c.tp, c.pp) for c in choice.ranked if c.cp == 1}
    assert layouts == {(4, 1, 1), (2, 2, 1), (1, 4, 1), (2, 1, 2), (1, 2, 2), (1, 1, 4)}
    assert {c.cp for c in choice.ranked} == {1, 2, 4}  # every cp the 32-token rows allow is scored too
    assert all(c.dp * c.cp * c.tp * c.pp == 4 and 12 % (c.micro_batch_size * c.dp) == 0 for c in choice.ranked)
    assert all(c.zero_stage <= 1 for c in choice.ranked if c.pp > 1)
    assert choice.best.step_time == min(c.step_time for c in choice.ranked)
    text = choice.explain(3)
    assert "chose" in text and "#2" in text and "#4" in text and "#5" not in text


def test_auto_respects_device_memory():
    _, roomy = _search(*LLAMA_70B, "parallel=auto", "plan.world_size=64", "plan.device_memory_gb=1000")
    _, tight = _search(*LLAMA_70B, "parallel=auto", "plan.world_size=64", "plan.device_memory_gb=80")
    assert tight.over_memory > roomy.over_memory
    assert tight.best.memory <= 80 * GiB
    with pytest.raises(PlanError) as info:
        _search(*LLAMA_70B, "parallel=auto", "plan.world_size=8", "plan.device_memory_gb=8")
    assert info.value.key == "plan.device_memory_gb" and "smallest needs" in str(info.value)


def test_auto_with_no_layout_the_rules_accept_says_why():
    """7 ranks for gpt_tiny (6 heads, 4 blocks, batch 12): dp=7 does not divide the batch, and tp=7 or pp=7
    are refused by the plan's own rules; the error shows one refused layout with the rule's message."""
    with pytest.raises(PlanError) as info:
        _search("+recipe=gpt_tiny", "parallel=auto", "plan.world_size=7")
    message = str(info.value)
    assert info.value.key == "plan.world_size" and "no layout of 7 ranks passes the plan's rules" in message
    assert "e.g. dp=1" in message and "change the world size or the batch" in message


def test_auto_plan_is_what_resolve_returns(monkeypatch):
    import hybridtrain.plan.calibrate as calibrate

    monkeypatch.setattr(calibrate, "rates", lambda *a, **k: RATES)
    cfg = cfg_of("+recipe=gpt_tiny", "parallel=auto", "plan.world_size=4", "model.config.n_head=4")
    lines = []
    plan, _ = resolve(cfg, CPU, announce=lines.append)
    assert plan.world_size == 4 and not cfg.parallel.auto
    assert f"chose dp={plan.dims.dp} tp={plan.dims.tp} pp={plan.dims.pp} micro={plan.micro_batch_size}" in lines[0]


def test_calibration_is_cached(tmp_path, monkeypatch):
    import hybridtrain.plan.calibrate as calibrate

    monkeypatch.setenv("HYBRIDTRAIN_CACHE", str(tmp_path))
    first = calibrate.rates(1, shape=(8, 16))  # probes: matmul, tiny block, a 2-process gloo all-reduce
    assert first.flops > 0 and first.latency > 0 and first.bandwidth > 0 and first.measured_link
    assert len(list((tmp_path / "calibration").glob("*.json"))) == 1

    def no_probe(*a, **k):
        raise AssertionError("probed again despite the cache")

    monkeypatch.setattr(calibrate, "matmul_flops", no_probe)
    monkeypatch.setattr(calibrate, "allreduce_link", no_probe)
    assert calibrate.rates(1, shape=(8, 16)) == first


# --- verify --------------------------------------------------------------------------------------

def test_verify_twin_keeps_ratios_and_divisibility():
    from hybridtrain.verify import shrink

    cfg = cfg_of(*LLAMA_70B)
    plan, hf = resolve(cfg, Machine())
    twin = shrink(cfg, plan, hf, 3)["model"]
    assert twin["num_attention_heads"] // twin["num_key_value_heads"] == 64 // 8
    for key in ("num_attention_heads", "num_key_value_heads", "intermediate_size"):
        assert twin[key] % plan.dims.tp == 0, key
    assert twin["num_hidden_layers"] >= plan.dims.pp and twin["hidden_size"] <= 1024
    assert twin["intermediate_size"] / twin["hidden_size"] == pytest.approx(28672 / 8192, rel=0.1)


def test_verify_compare():
    from hybridtrain.verify import compare

    want = [{"step": 1, "loss": 9.0, "grad_norm": 2.0}, {"step": 2, "loss": 8.5, "grad_norm": 1.5}]
    close = [{"step": 1, "loss": 9.0 * (1 + 5e-5), "grad_norm": 2.0}, {"step": 2, "loss": 8.5, "grad_norm": 1.5005}]
    assert compare(close, want, "fp32").ok
    off = [{"step": 1, "loss": 9.0, "grad_norm": 2.0}, {"step": 2, "loss": 8.6, "grad_norm": 1.5}]
    verdict = compare(off, want, "fp32")
    assert not verdict.ok and "<-- differs" in verdict.lines[1]
    assert not compare(want[:1], want, "fp32").ok
    assert compare(off, want, "bf16").ok  # 1.2% within bf16's tolerance


def test_auto_on_the_issues_command_line(monkeypatch):
    """``+recipe=llama_7b parallel=auto plan.device_memory_gb=80 plan.world_size=64``: 64 ranks are
    8 nodes of the recipe's 8 GPUs; the chosen plan fits 80 GiB and validates."""
    import hybridtrain.plan.calibrate as calibrate

    monkeypatch.setattr(calibrate, "rates", lambda *a, **k: RATES)
    cfg = cfg_of("+recipe=llama_7b", "parallel=auto", "plan.device_memory_gb=80", "plan.world_size=64")
    plan, hf = resolve(cfg, CPU)
    assert plan.world_size == 64 and cfg.launcher.nodes == 8
    report = build_report(cfg, plan, hf, 80 * GiB)
    assert max(st.memory.total for st in report.stages) <= 80 * GiB


GPU_RATES = Rates(flops=3e14, latency=2e-5, bandwidth=1e11, device="cuda", threads=1, layer_overhead=2e-5)
GRID_CPU = Machine(gpus_per_node=0, fp16_supported=False, cpu_cores=8, device_memory_bytes=64 * GiB)
GRID_GPUS = Machine(gpus_per_node=8, fp16_supported=True, cpu_cores=64, device_memory_bytes=80 * GiB)
AUTO_GRID = [
    # (model overrides, world sizes, machine, precisions, plan.device_memory_gb values (None: the device's))
    (("+recipe=gpt_tiny",), (1, 2, 4, 8), GRID_CPU, ("fp32", "bf16"), (None, 0.02)),
    (("+recipe=llama_tiny",), (1, 3, 4), GRID_CPU, ("fp32", "bf16"), (None, 0.02)),
    (("+recipe=gpt_tiny", "launcher.gpus=true"), (2, 8), GRID_GPUS, ("fp32", "bf16", "fp16"), (None, 2.5)),
    (("+recipe=llama_7b", "launcher.nodes=1"), (8,), GRID_GPUS, ("fp32", "bf16", "fp16"), (None, 40)),
    (("+recipe=llama_7b", "launcher=slurm", "launcher.gpu_type=h100-80gb", "launcher.gpus_per_node=8"), (32,),
     GRID_CPU, ("bf16", "fp16"), (None,)),
    ((*LLAMA_70B, "launcher=slurm", "launcher.gpu_type=h200", "launcher.gpus_per_node=8"), (64,), GRID_CPU,
     ("bf16",), (None, 80)),
]


def _grid_cases():
    for model, worlds, machine, precisions, memories in AUTO_GRID:
        for world, precision, memory in itertools.product(worlds, precisions, memories):
            overrides = (*model, "parallel=auto", f"plan.world_size={world}", f"trainer.precision={precision}")
            if memory is not None:
                overrides += (f"plan.device_memory_gb={memory}",)
            name = "llama_70b" if model[:len(LLAMA_70B)] == tuple(LLAMA_70B) else model[0].split("=")[-1]
            yield pytest.param(overrides, machine, id=f"{name}-{world}-{precision}-{memory}")


@pytest.mark.parametrize("overrides,machine", list(_grid_cases()))
def test_auto_picks_a_plan_that_validates_and_fits(overrides, machine):
    """Over recipes, world sizes, precisions and device memories: the layout ``parallel=auto`` picks passes
    ``build_plan`` as any run does, its memory estimate is the plan report's for that layout (DeepSpeed's
    layout for the precision and ZeRO stage, ``plan/memory.py``), and it fits the rank's budget (the
    device's memory less the GPU headroom). No candidate it ranks is one the plan refuses."""
    from hybridtrain.plan import build_plan, rank_budget
    from hybridtrain.plan.auto import apply, search

    cfg = cfg_of(*overrides)
    hf = model_config(cfg)
    rates = None if cfg.launcher.name != "local" else (GPU_RATES if machine.gpus_per_node else RATES)
    try:
        choice = search(cfg, hf, machine, rates)
    except PlanError as err:  # nothing fits or nothing is valid: said so, never a bad pick
        assert err.key in ("plan.device_memory_gb", "plan.world_size"), str(err)
        assert "smallest needs" in str(err) or "passes the plan's rules" in str(err)
        return
    apply(cfg, choice.best)
    plan = build_plan(cfg, hf, machine, int(hf.vocab_size))
    assert (plan.dims.dp, plan.dims.tp, plan.dims.pp, plan.zero_stage) == (choice.best.dp, choice.best.tp, choice.best.pp,
                                                            choice.best.zero_stage)
    assert f"trainer.precision={plan.precision}" in overrides
    budget = rank_budget(cfg, plan, machine)
    assert budget == choice.device_memory and budget > 0
    report = build_report(cfg, plan, hf, budget)
    worst = max(st.memory.total for st in report.stages)
    assert worst == choice.best.memory <= budget
    assert not [w for w in report.warnings if "exceeds the budget" in w]
    for c in choice.ranked:  # every layout it ranks is one the plan accepts and that fits
        assert c.memory <= budget and (c.zero_stage > 0 or plan.precision == "fp32")
        assert c.pp == 1 or c.zero_stage <= 1
        if cfg.launcher.nodes > 1:
            assert (world_per_node := plan.world_size // plan.nodes) % c.tp == 0, (c.label(), world_per_node)


def test_auto_in_bf16_no_longer_prefers_zero_0():
    """The issue's case: llama_7b in bf16 on 8 x 80 GB. Before, auto ranked ZeRO-0 first (estimated at
    73.7 GiB at tp = 1, where DeepSpeed's unpartitioned 16-bit optimizer needs about 125 GiB) and the plan
    then refused it; now no ZeRO-0 layout is a candidate and the pick fits 80 GiB less the headroom."""
    from hybridtrain.plan.auto import search

    cfg = cfg_of("+recipe=llama_7b", "launcher.nodes=1", "parallel=auto", "plan.world_size=8")
    choice = search(cfg, model_config(cfg), GRID_GPUS, GPU_RATES)
    assert cfg.trainer.precision == "bf16" and choice.refused > 0
    assert all(c.zero_stage >= 1 for c in choice.ranked)
    assert choice.best.memory <= choice.device_memory == int(0.9 * 80 * GiB - 2 * GiB)


def test_auto_prices_groups_across_nodes_at_the_inter_node_link():
    """The same layout on one node of 8 and on two nodes of 4: the data-parallel all-reduce crosses the
    network in the second and costs more; TP groups that would cross are never candidates."""
    from hybridtrain.plan.auto import search

    one = cfg_of("+recipe=llama_7b", "parallel=auto", "launcher=slurm", "launcher.gpu_type=a100-80gb",
                 "launcher.nodes=1", "launcher.gpus_per_node=8")
    two = cfg_of("+recipe=llama_7b", "parallel=auto", "launcher=slurm", "launcher.gpu_type=a100-80gb",
                 "launcher.nodes=2", "launcher.gpus_per_node=4")
    a, b = search(one, model_config(one), GRID_CPU), search(two, model_config(two), GRID_CPU)
    same = {(c.dp, c.tp, c.pp, c.micro_batch_size, c.zero_stage, c.activation_checkpointing): c for c in a.ranked}
    pairs = [(same[k], c) for c in b.ranked
             if (k := (c.dp, c.tp, c.pp, c.micro_batch_size, c.zero_stage, c.activation_checkpointing)) in same]
    crossing_dp = [(x, y) for x, y in pairs if y.dp > 1 and y.pp == 1]
    assert crossing_dp and all(y.parts["dp_comm"] > x.parts["dp_comm"] for x, y in crossing_dp)
    assert all(c.tp <= 4 for c in b.ranked) and any(c.tp == 8 for c in a.ranked)
