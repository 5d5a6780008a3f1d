"""Planning for GPUs and clusters without one: the device facts a plan uses (this machine, or a cluster's
nodes from ``launcher.gpu_type``), the precision default, the GPU memory headroom, TP groups across nodes
and the inter-node links of the cost model (issue #12, points 7-10)."""
from __future__ import annotations

import pytest

from helpers.config import cfg_of
from hybridtrain.config.choices import GpuType
from hybridtrain.plan import Machine, PlanError, rank_budget, resolve
from hybridtrain.plan.calibrate import INTER_NODE_LINK, Rates, planned_rates
from hybridtrain.gpus import GPU_PEAK_TFLOPS, GPU_SPECS, GPU_TYPES, GPUS, gpu_named
from hybridtrain.observe.peak import gpu_peak_tflops
from hybridtrain.plan.devices import GiB, gpu_peak_flops, memory_budget, planned_machine

CPU = Machine(gpus_per_node=0, fp16_supported=False, cpu_cores=4, device_memory_bytes=64 * GiB)
"""A login node or laptop: no GPU, no fp16 kernels, 64 GiB of RAM."""
GPUS8 = Machine(gpus_per_node=8, fp16_supported=True, cpu_cores=64, device_memory_bytes=80 * GiB)
V100 = Machine(gpus_per_node=8, fp16_supported=True, cpu_cores=64, device_memory_bytes=32 * GiB, bf16_supported=False)


def test_every_gpu_type_has_a_spec_and_a_peak():
    """The views of the one GPU table (hybridtrain/gpus.py): the enum of launcher.gpu_type, the plan's specs
    and the peak rows agree, and a row's facts are plausible."""
    assert GPU_TYPES == tuple(str(g) for g in GpuType)  # in table order
    assert sum(len(gpu.memory_gib) for gpu in GPUS) == len(GPU_SPECS)  # no gpu_type in two rows
    assert len(GPU_PEAK_TFLOPS) == len(GPUS)  # no name in two rows
    for name, spec in GPU_SPECS.items():
        assert spec.peak in GPU_PEAK_TFLOPS, name
        assert 10 < spec.memory_gib < 200 and spec.link[1] > 1e10, name
    for gpu in GPUS:
        assert gpu.tflops["bf16"] >= gpu.tflops["tf32"] >= gpu.tflops["fp32"] > 0, gpu.name
        assert (gpu.link is not None) == bool(gpu.memory_gib), gpu.name  # a gpu_type needs its node's link


def test_a_gpu_type_plans_with_the_peak_its_device_name_finds():
    """What the planner assumes for a gpu_type is what MFU later divides by on that GPU."""
    for spec in GPU_SPECS.values():
        for precision, tf32 in [("bf16", False), ("fp16", False), ("fp32", True), ("fp32", False)]:
            assert gpu_peak_flops(spec, precision, tf32) == gpu_peak_tflops(f"NVIDIA {spec.peak}", precision,
                                                                            tf32)[1] * 1e12
    assert gpu_peak_flops(GPU_SPECS["h100-pcie"], "bf16", False) == 756.5e12
    assert not GPU_SPECS["v100-32gb"].bf16 and GPU_SPECS["v100-32gb"].memory_gib == 31.7


def test_the_longest_device_name_fragment_wins():
    for gpu in GPUS:
        assert gpu_named(f"NVIDIA {gpu.name}") is gpu  # every row is reachable
    assert gpu_named("NVIDIA GH200 480GB").name == "GH200"  # not H200
    assert gpu_named("NVIDIA H100 PCIe").name == "H100 PCIe"  # not H100
    assert gpu_named("NVIDIA L40S").name == "L40S" and gpu_named("NVIDIA A10G").name == "A10"
    assert gpu_named("NVIDIA A800-SXM4-80GB").name == "A800"  # peak rows without a gpu_type
    assert gpu_named("Tesla T4") is None


@pytest.mark.parametrize("overrides,machine,want", [
    ((), CPU, "fp32"),                                              # CPU processes: the CPU suite's fp32
    ((), GPUS8, "bf16"),                                            # this machine's GPUs
    ((), V100, "fp32"),                                             # GPUs without bf16
    (("launcher.gpus=false",), GPUS8, "fp32"),
    (("launcher=slurm", "launcher.nodes=2", "launcher.gpus_per_node=4"), GPUS8, "fp32"),  # the nodes' GPUs unknown
    (("launcher=slurm", "launcher.nodes=2", "launcher.gpus_per_node=4", "launcher.gpu_type=h100-80gb"), CPU, "bf16"),
    (("launcher=slurm", "launcher.nodes=2", "launcher.gpus_per_node=4", "launcher.gpus=true"), CPU, "bf16"),
    (("launcher=slurm", "launcher.nodes=2", "launcher.gpus_per_node=4", "launcher.gpu_type=v100-32gb"), CPU, "fp32"),
    (("trainer.precision=fp32",), GPUS8, "fp32"),                   # the user's choice stands
], ids=["cpu", "gpus", "v100", "gpus_false", "slurm_unknown", "slurm_h100", "slurm_gpus", "slurm_v100", "asked"])
def test_precision_default_follows_the_planned_devices(overrides, machine, want):
    cfg = cfg_of("+recipe=gpt_tiny", "trainer.global_batch_size=16", *overrides)
    plan, _ = resolve(cfg, machine)
    assert plan.precision == want and cfg.trainer.precision == want  # resolved into config.yaml


def test_gpu_recipe_trains_in_bf16_by_default():
    plan, _ = resolve(cfg_of("+recipe=llama_7b"), CPU)  # launcher.gpus=true: planned as GPUs anywhere
    assert plan.precision == "bf16"


def test_bf16_on_a_gpu_without_it_is_refused():
    for machine, overrides, where in [(V100, (), "this machine's GPU"),
                                      (CPU, ("launcher=slurm", "launcher.nodes=2", "launcher.gpus_per_node=4",
                                             "launcher.gpu_type=v100-16gb"), "launcher.gpu_type=v100-16gb")]:
        cfg = cfg_of("+recipe=gpt_tiny", "trainer.precision=bf16", "trainer.global_batch_size=16", *overrides)
        with pytest.raises(PlanError) as info:
            resolve(cfg, machine)
        assert info.value.key == "trainer.precision"
        assert where in str(info.value) and "bf16 needs an Ampere or newer GPU" in str(info.value)
        assert "use trainer.precision=fp16 or fp32" in str(info.value)


def test_a_cluster_plans_for_its_nodes_not_for_this_machine():
    """A GPU-less login node without fp16 kernels plans an fp16 job for H200 nodes: the nodes' facts come
    from launcher.gpu_type, and nothing of this machine leaks in (its RAM, its missing fp16, its GPUs)."""
    cfg = cfg_of("+recipe=gpt_tiny", "launcher=slurm", "launcher.nodes=2", "launcher.gpus_per_node=4",
                 "launcher.gpu_type=h200", "trainer.precision=fp16", "trainer.global_batch_size=16")
    plan, _ = resolve(cfg, CPU)  # fp16 is refused on CPU here, allowed on the nodes
    assert plan.precision == "fp16" and plan.padded_vocab_size % 64 == 0
    nodes = planned_machine(cfg.launcher, CPU)
    assert nodes.device_memory_bytes == int(140.0 * GiB) and nodes.fp16_supported and nodes.gpu_type == "h200"
    assert planned_machine(cfg.launcher, GPUS8) == nodes  # whatever GPU the submitting machine has
    assert rank_budget(cfg, plan, CPU) == int(0.9 * 140.0 * GiB - 2 * GiB)
    # CPU nodes of a cluster: memory unknown (not this machine's RAM divided by the ranks)
    cpu_nodes = cfg_of("+recipe=gpt_tiny", "launcher=slurm", "launcher.nodes=2")
    plan, _ = resolve(cpu_nodes, CPU)
    assert plan.precision == "fp32" and rank_budget(cpu_nodes, plan, CPU) == 0
    local, _ = resolve(cfg_of("+recipe=gpt_tiny", "parallel.dp=2"), CPU)
    assert rank_budget(cfg_of("+recipe=gpt_tiny"), local, CPU) == 32 * GiB  # launcher=local: RAM / 2 ranks


def test_cluster_rates_come_from_the_gpu_type():
    cfg = cfg_of("+recipe=gpt_tiny", "launcher=multinode", "launcher.nodes=2", "launcher.gpus_per_node=8",
                 "launcher.gpu_type=a100-80gb", "launcher.no_ssh=true", "launcher.node_rank=0", "launcher.master_addr=h")
    nodes = planned_machine(cfg.launcher, CPU)
    rates = planned_rates(cfg.launcher, nodes, "bf16", True, 1)
    assert rates.device == "cuda" and rates.flops == pytest.approx(0.4 * 312e12)
    assert (rates.latency, rates.bandwidth) == GPU_SPECS["a100-80gb"].link and not rates.measured_link
    assert planned_rates(cfg.launcher, nodes, "fp32", False, 1).flops == pytest.approx(0.4 * 19.5e12)
    assert planned_rates(cfg.launcher, nodes, "fp32", True, 1).flops == pytest.approx(0.4 * 156e12)


def test_inter_node_links_are_slower():
    rates = Rates(flops=1e14, latency=1e-5, bandwidth=3e11, device="cuda", threads=1)
    assert rates.link(False) == (1e-5, 3e11)
    assert rates.link(True) == INTER_NODE_LINK["cuda"] and INTER_NODE_LINK["cuda"][1] < 3e11
    slow_node = Rates(flops=1e10, latency=1e-3, bandwidth=1e8, device="cpu", threads=1)
    assert slow_node.link(True) == (1e-3, 1e8)  # never faster across nodes than within one


@pytest.mark.parametrize("machine,overrides,want_gib", [
    (GPUS8, (), 0.9 * 80 - 2),                                      # the GPU's memory less the headroom
    (GPUS8, ("plan.device_memory_gb=40",), 0.9 * 40 - 2),           # a stated device size: the same headroom
    (GPUS8, ("plan.memory_headroom=0", "plan.memory_reserved_gb=0"), 80),
    (GPUS8, ("plan.memory_headroom=0.2", "plan.memory_reserved_gb=4"), 0.8 * 80 - 4),
    (CPU, (), 64),                                                  # CPU processes: the whole RAM (1 rank)
    (CPU, ("plan.device_memory_gb=8",), 8),
], ids=["gpu", "gpu_stated", "no_headroom", "more_headroom", "cpu", "cpu_stated"])
def test_gpu_memory_budget_keeps_headroom(machine, overrides, want_gib):
    cfg = cfg_of("+recipe=gpt_tiny", *overrides)
    assert memory_budget(cfg.plan, cfg.launcher, machine, 1) == int(want_gib * GiB)


def test_headroom_reaches_warnings_partition_and_auto():
    """A stage that fits 80 GiB but not 80 GiB less the headroom: the plan warns, the balanced partition
    moves layers, parallel=auto refuses it."""
    from hybridtrain.plan.report import build_report

    cfg = cfg_of("+recipe=llama_7b", "launcher.nodes=1", "parallel.tp=8", "parallel.pp=1", "parallel.zero_stage=1",
                 "plan.device_memory_gb=20")
    plan, hf = resolve(cfg, CPU)
    total = build_report(cfg, plan, hf, rank_budget(cfg, plan, CPU)).stages[0].memory.total
    assert 0.9 * 20 * GiB - 2 * GiB < total < 20 * GiB  # fits the device, not its budget
    report = build_report(cfg, plan, hf, rank_budget(cfg, plan, CPU))
    assert any("exceeds the budget" in w and "plan.memory_headroom" in w for w in report.warnings)
    roomy = cfg_of("+recipe=llama_7b", "launcher.nodes=1", "parallel.tp=8", "parallel.pp=1", "parallel.zero_stage=1",
                   "plan.device_memory_gb=20", "plan.memory_headroom=0", "plan.memory_reserved_gb=0")
    plan, hf = resolve(roomy, CPU)
    assert not build_report(roomy, plan, hf, rank_budget(roomy, plan, CPU)).warnings


@pytest.mark.parametrize("value,key,fragment", [
    ("plan.memory_headroom=1", "plan.memory_headroom", "the share of a GPU's memory kept free"),
    ("plan.memory_headroom=-0.1", "plan.memory_headroom", "must be in [0, 1)"),
    ("plan.memory_reserved_gb=-1", "plan.memory_reserved_gb", "must be >= 0"),
], ids=["headroom_all", "headroom_negative", "reserve_negative"])
def test_headroom_keys_are_checked(value, key, fragment):
    with pytest.raises(PlanError) as info:
        resolve(cfg_of("+recipe=gpt_tiny", value), CPU)
    assert info.value.key == key and fragment in str(info.value)


@pytest.mark.parametrize("launcher", ["slurm", "multinode"])
def test_tensor_parallel_group_across_nodes_is_refused(launcher):
    extra = ("launcher.no_ssh=true", "launcher.node_rank=0", "launcher.master_addr=h") if launcher == "multinode" else ()
    cfg = cfg_of("+recipe=llama_tiny", f"launcher={launcher}", "launcher.nodes=2", "launcher.gpus_per_node=3",
                 "parallel.tp=6", *extra)
    with pytest.raises(PlanError) as info:
        resolve(cfg, CPU)
    message = str(info.value)
    assert info.value.key == "parallel.tp" and "parallel.tp=6 does not divide the 3 ranks per node" in message
    assert "launcher.gpus_per_node=3" in message and "use tp in [1, 3]" in message
    ok = cfg_of("+recipe=llama_tiny", f"launcher={launcher}", "launcher.nodes=2", "launcher.gpus_per_node=6",
                "parallel.tp=6", *extra)
    assert resolve(ok, CPU)[0].dims.tp == 6  # a TP group per node: dp crosses


def test_a_dry_run_of_a_gpu_recipe_on_a_laptop_plans_gpus_of_unknown_memory():
    cfg = cfg_of("+recipe=llama_7b")
    nodes = planned_machine(cfg.launcher, CPU)
    assert nodes.device_memory_bytes == 0 and nodes.fp16_supported
    with pytest.raises(PlanError) as info:
        resolve(cfg_of("+recipe=llama_7b", "parallel=auto"), CPU)
    assert info.value.key == "plan.device_memory_gb" and "GPUs of unknown memory" in str(info.value)


def test_llama_7b_as_typed_fills_one_8_gpu_node_and_eight_nodes():
    """Issue 29.7: the recipe pinned launcher.nodes=4 and dp=1, so as typed on one 8-GPU node, and the
    README's ``launcher.nodes=8 launcher.gpus_per_node=8``, exited 2; dp now fills the devices."""
    plan, _ = resolve(cfg_of("+recipe=llama_7b"), GPUS8)
    assert (plan.dims.dp, plan.dims.tp, plan.dims.pp, plan.world_size) == (2, 2, 2, 8)
    plan, _ = resolve(cfg_of("+recipe=llama_7b", "launcher.nodes=8", "launcher.gpus_per_node=8"), CPU)
    assert (plan.dims.dp, plan.world_size, plan.nodes) == (16, 64, 8)


def test_tp_across_nodes_states_the_ranks_the_user_asked_for():
    """Issue 29.7: 32 ranks on 8 nodes of 8 GPUs (an explicit parallel.dp=1) said "4 ranks per node
    (launcher.gpus_per_node=8)"; the message now gives the product, the nodes and the devices, and the dp
    that fills them."""
    cfg = cfg_of("+recipe=llama_7b", "launcher.nodes=8", "launcher.gpus_per_node=8", "parallel.tp=8",
                 "parallel.pp=4", "parallel.dp=1")
    with pytest.raises(PlanError) as info:
        resolve(cfg, CPU)
    message = str(info.value)
    assert info.value.key == "parallel.tp" and "does not divide the 4 ranks per node" in message
    assert "dp x tp x pp = 1 x 8 x 4 = 32 ranks on launcher.nodes=8" in message
    assert "launcher.gpus_per_node=8 gives 64 devices" in message and "parallel.dp=2 (or null" in message


def test_the_embedded_corpus_holds_one_batch_of_the_7b_recipe(tmp_path):
    """Issue 29.7: 256 sequences of 4096 tokens were more than the embedded corpus holds (about 230): the
    controller's data check (check_data_counts) refused the recipe after tokenizing."""
    from hybridtrain.data.prepare import prepare
    from hybridtrain.plan.data import check_data_counts

    cfg = cfg_of("+recipe=llama_7b", f"data.cache_dir={tmp_path}")
    plan, _ = resolve(cfg, GPUS8)
    prepared = prepare(cfg.data, cfg.trainer.seed, log=lambda line: None)
    assert prepared.num_samples("train") >= plan.global_batch_size
    assert check_data_counts(cfg, plan, prepared.num_samples("train"), prepared.num_samples("val")) == 10000


@pytest.mark.parametrize("gpu,micro,expected", [("h100-80gb", 1, False), ("a100-40gb", 2, True)],
                         ids=["fits_keeps", "over_recomputes"])
def test_activation_checkpointing_null_is_on_only_where_the_rank_would_not_fit(gpu, micro, expected):
    """Issue 29.8: the 7B recipe forced activation checkpointing (+25-33% compute) where the plan showed
    room to keep the activations. ``null``: the plan compares the fullest rank with the activations kept
    against its budget, resolves the key (config.yaml records the value) and says which and why."""
    from hybridtrain.plan.memory import GiB as GIB
    from hybridtrain.plan.report import build_report

    said = []
    cfg = cfg_of("+recipe=llama_7b", "launcher=slurm", f"launcher.gpu_type={gpu}",
                 f"parallel.micro_batch_size={micro}")
    plan, hf = resolve(cfg, CPU, announce=said.append)
    assert cfg.parallel.activation_checkpointing is expected
    budget = rank_budget(cfg, plan, CPU)
    line, = [s for s in said if "activation checkpointing" in s]
    assert line.startswith(f"[hybridtrain] activation checkpointing {'on' if expected else 'off'} "
                           "(parallel.activation_checkpointing: null)")
    assert f"{budget / GIB:.2f} GiB budget" in line
    totals = {}
    for on in (False, True):
        cfg.parallel.activation_checkpointing = on
        totals[on] = max(st.memory.total for st in build_report(cfg, plan, hf, budget).stages)
    assert (totals[False] > budget) is expected and totals[True] <= budget
    assert f"{totals[False] / GIB:.2f} GiB with the activations kept" in line


def test_activation_checkpointing_null_with_unknown_memory_keeps_activations_and_says_so():
    """A GPU recipe planned on a laptop (GPUs of unknown memory): off, naming the keys that let it check;
    an explicit value is kept as given, with no line."""
    said = []
    cfg = cfg_of("+recipe=llama_7b")
    resolve(cfg, CPU, announce=said.append)
    assert cfg.parallel.activation_checkpointing is False
    assert any("the device memory is unknown" in s and "plan.device_memory_gb" in s for s in said)
    said.clear()
    cfg = cfg_of("+recipe=llama_7b", "parallel.activation_checkpointing=true", "plan.device_memory_gb=80")
    resolve(cfg, CPU, announce=said.append)
    assert cfg.parallel.activation_checkpointing is True and not any("activation checkpointing" in s for s in said)


@pytest.mark.parametrize("value", ["-1", "0"])
@pytest.mark.parametrize("auto", [False, True], ids=["fixed_layout", "parallel_auto"])
def test_a_device_memory_at_or_below_zero_is_a_range_error(value, auto):
    """Fault probe n19-n22, n27: ``plan.device_memory_gb`` <= 0 passed a dry run without a word, and with
    ``parallel=auto`` read as "GPUs of unknown memory"; it is a range error naming the key, either way."""
    extra = ("parallel=auto", "plan.world_size=8") if auto else ()
    with pytest.raises(PlanError, match=rf"^plan.device_memory_gb: must be > 0 \(GiB of one device\), got {value}"):
        resolve(cfg_of("+recipe=llama_7b", f"plan.device_memory_gb={value}", *extra), GPUS8)


def test_a_device_memory_within_the_reserve_says_the_reserve_leaves_no_budget():
    """Fault probe n19: 1 GiB with the 2 GiB reserve left a budget of 0, which ``parallel=auto`` took for unknown
    memory ("set plan.device_memory_gb", which was set); now both keys are named, with and without auto."""
    want = (r"^plan.device_memory_gb: 1 GiB leaves no budget after plan.memory_headroom=0.1 \(0.10 GiB\) and "
            r"plan.memory_reserved_gb=2 kept free; give one GPU's real memory, or lower plan.memory_reserved_gb$")
    with pytest.raises(PlanError, match=want):
        resolve(cfg_of("+recipe=llama_7b", "plan.device_memory_gb=1", "parallel=auto", "plan.world_size=8"), GPUS8)
    with pytest.raises(PlanError, match=want):
        resolve(cfg_of("+recipe=llama_7b", "plan.device_memory_gb=1"), GPUS8)
