"""Which GPUs the ranks use (hybridtrain/launch/devices.py) and the refusal to train on CPU cores when
GPUs were asked for: pure functions of the environment, checked without a GPU."""
from __future__ import annotations


import pytest

from helpers.config import compose
from hybridtrain.config.schema import LauncherConfig
from hybridtrain.errors import PlanError
from hybridtrain.launch.devices import (asked_for_gpus, check_gpus, driver_gpus, local_devices, slurm_device_index,
                                        slurm_gpus_expected, visible_devices)
from hybridtrain.launch.env import rank_env
from hybridtrain.launch.ranks import rank_env as local_rank_env
from hybridtrain.plan import resolve
from hybridtrain.plan.types import Machine


@pytest.mark.parametrize("value,devices", [(None, None), ("", []), ("-1", []), ("2,3", ["2", "3"]),
                                           (" 0, 1 ,", ["0", "1"]), ("GPU-8a1b", ["GPU-8a1b"])])
def test_visible_devices(value, devices):
    assert visible_devices({} if value is None else {"CUDA_VISIBLE_DEVICES": value}) == devices


def test_local_ranks_keep_the_users_visible_gpus():
    """Rank i gets the i-th entry of the user's CUDA_VISIBLE_DEVICES (UUIDs too), not GPU i."""
    env = {"CUDA_VISIBLE_DEVICES": "2,3,5"}
    assert local_devices(2, env, torch_gpus=3) == ["2", "3"]
    assert local_devices(2, {"CUDA_VISIBLE_DEVICES": "GPU-8a1b,GPU-77ff"}, torch_gpus=2) == ["GPU-8a1b", "GPU-77ff"]
    assert local_devices(2, {}, torch_gpus=8) == ["0", "1"]  # nothing restricted
    assert local_devices(2, {"CUDA_VISIBLE_DEVICES": ""}, torch_gpus=0) == []  # CPU processes: CUDA_VISIBLE_DEVICES=""
    ranks = [local_rank_env({}, r, 2, 1234, local_devices(2, env, torch_gpus=3)) for r in range(2)]
    assert {e["CUDA_VISIBLE_DEVICES"] for e in ranks} == {"2,3"} and [e["LOCAL_RANK"] for e in ranks] == ["0", "1"]


def test_runner_include_selects_those_gpus_in_deepspeed():
    """What the deepspeed runner makes of ``--include localhost:2,3`` on a node of 4 GPUs
    (``deepspeed/launcher/runner.py``): exactly GPUs 2 and 3, which launch.py then exports as
    CUDA_VISIBLE_DEVICES to the ranks."""
    from deepspeed.launcher.runner import parse_inclusion_exclusion

    assert dict(parse_inclusion_exclusion({"localhost": 4}, "localhost:2,3", "")) == {"localhost": [2, 3]}


@pytest.mark.parametrize("value,fragment", [("3", "shows 1 GPU(s)")])
def test_unusable_visible_devices_are_config_errors(value, fragment):
    with pytest.raises(PlanError) as info:
        local_devices(2, {"CUDA_VISIBLE_DEVICES": value}, torch_gpus=2)
    assert info.value.key == "launcher.gpus_per_node" and fragment in str(info.value)


@pytest.mark.parametrize("visible,local_id,tasks,index", [
    (None, 3, 4, 3),          # every task sees the node's GPUs: its local id
    ("0,1,2,3", 3, 4, 3),
    ("3", 3, 4, 0),           # --gpus-per-task=1 / --gpu-bind: its own GPU, index 0
    ("0", 0, 1, 0),
    ("0,1,2,3,4,5,6,7", 3, 4, 3),  # more GPUs than tasks: its local id
])
def test_slurm_device_index(visible, local_id, tasks, index):
    env = {} if visible is None else {"CUDA_VISIBLE_DEVICES": visible}
    assert slurm_device_index(env, local_id, tasks) == index


@pytest.mark.parametrize("visible", ["6,7", "0,1,2,3"])
def test_slurm_binding_several_gpus_per_task_is_refused(visible):
    """``1 < k < tasks`` GPUs bound to each task (``--gpus-per-task=2``; ``--gpu-bind=closest``: the 4 GPUs of a
    socket for each of its 4 tasks): before, every such task took index 0 (``LOCAL_RANK=0``), so tasks sharing
    GPUs all trained on the first (NCCL "Duplicate GPU"). Refused, naming the options that work."""
    with pytest.raises(RuntimeError, match=r"bound task 3 of this node's 8 to \d GPUs.*--gpus-per-task=1 or "
                                           r"--gpu-bind=single:1"):
        slurm_device_index({"CUDA_VISIBLE_DEVICES": visible}, 3, 8)


def test_slurm_rank_env_with_one_gpu_per_task():
    env = {"SLURM_PROCID": "3", "SLURM_LOCALID": "1", "SLURM_NTASKS": "4", "SLURM_NNODES": "2", "SLURM_NODEID": "1",
           "SLURM_JOB_NODELIST": "n[1-2]", "SLURM_JOB_ID": "7", "CUDA_VISIBLE_DEVICES": "1"}
    out = rank_env(env, expand=lambda _: ["n1", "n2"])
    assert out["LOCAL_RANK"] == "0" and out["RANK"] == "3"
    del env["CUDA_VISIBLE_DEVICES"]
    assert rank_env(env, expand=lambda _: ["n1", "n2"])["LOCAL_RANK"] == "1"


def _launcher(**kw) -> LauncherConfig:
    lau = LauncherConfig()
    for k, v in kw.items():
        setattr(lau, k, v)
    return lau


def test_what_asking_for_gpus_means():
    assert asked_for_gpus(_launcher(gpus=True), {}, driver=0)
    assert not asked_for_gpus(_launcher(gpus=False), {}, driver=8)
    assert asked_for_gpus(_launcher(), {}, driver=8)  # a GPU node: a CPU build of torch must not train there
    assert not asked_for_gpus(_launcher(), {"CUDA_VISIBLE_DEVICES": ""}, driver=8)  # hidden on purpose
    assert not asked_for_gpus(_launcher(), {}, driver=0)  # a laptop: CPU processes


@pytest.mark.parametrize("kw,env,driver,fragment", [
    ({"gpus": True}, {}, 0, "launcher.gpus=true but torch"),
    ({}, {}, 4, "the NVIDIA driver lists 4 GPU(s)"),
])
def test_gpus_asked_but_torch_sees_none(kw, env, driver, fragment):
    with pytest.raises(PlanError) as info:
        check_gpus(_launcher(**kw), 0, env, driver, "2.13.0+cpu")
    msg = str(info.value)
    assert info.value.key == "launcher.gpus" and fragment in msg and "2.13.0+cpu" in msg
    assert "scripts/install.sh --cuda" in msg and "launcher.gpus=false" in msg


@pytest.mark.parametrize("kw,torch_gpus", [({"gpus": True}, 1), ({"gpus": True, "dry_run": True}, 0),
                                           ({"gpus": True, "name": "slurm"}, 0), ({"gpus": False}, 0)])
def test_gpus_check_passes(kw, torch_gpus):
    check_gpus(_launcher(**kw), torch_gpus, {}, 8)  # GPUs seen, a dry run, checked on the node, CPU chosen


def test_driver_gpus_counts_the_driver_folders(tmp_path):
    assert driver_gpus(tmp_path / "absent") == 0
    for i in range(2):
        (tmp_path / f"0000:0{i}:00.0").mkdir()
    assert driver_gpus(tmp_path) == 2


def test_slurm_task_with_gpus_but_no_cuda_stops(monkeypatch, capsys):
    from hybridtrain import worker

    assert slurm_gpus_expected({"SLURM_GPUS_ON_NODE": "4"}) and not slurm_gpus_expected({})
    monkeypatch.setenv("SLURM_GPUS_ON_NODE", "4")
    assert worker._slurm_gpus_missing()  # this CPU machine: torch sees no CUDA device
    assert "SLURM gave this task 4 GPU(s) but torch" in capsys.readouterr().err
    monkeypatch.delenv("SLURM_GPUS_ON_NODE")
    assert not worker._slurm_gpus_missing()


def _plan(world: int):
    cfg = compose("+recipe=gpt_tiny", f"parallel.dp={world}")
    return resolve(cfg, Machine(gpus_per_node=0, cpu_cores=2))[0]


@pytest.mark.parametrize("machine,gpus,multiple", [(Machine(gpus_per_node=8), None, 64),
                                                   (Machine(gpus_per_node=0), None, 1),
                                                   (Machine(gpus_per_node=0), False, 1),
                                                   (Machine(gpus_per_node=0), True, 64)])
def test_vocab_pads_to_64_on_gpus_by_default(machine, gpus, multiple):
    cfg = compose("+recipe=gpt_tiny", "parallel.dp=1", "parallel.tp=3", "launcher.dry_run=true")
    cfg.launcher.gpus = gpus
    plan, _ = resolve(cfg, machine)
    assert cfg.model.vocab_pad_multiple == multiple  # resolved into the config the workers read
    assert plan.padded_vocab_size == {64: 8064, 1: 8001}[multiple]  # a multiple of 64 x tp, or of tp


@pytest.mark.parametrize("world,dp,tp,pp,gpus,fit", [
    (64, 2, 8, 4, 0, (2, False)),   # a laptop: CPU processes, the plan's dp
    (4, 2, 2, 1, 8, (2, False)),    # fits
    (64, 8, 8, 1, 8, (1, False)),   # one replica of tp=8 fits an 8-GPU node: fewer replicas
    (64, 2, 8, 4, 8, (2, True)),    # one replica needs 32 GPUs: the twin runs on CPU processes
])
def test_verify_twin_fits_the_local_gpus(world, dp, tp, pp, gpus, fit):
    from types import SimpleNamespace

    from hybridtrain.parallel.dims import ParallelDims
    from hybridtrain.verify import fit_devices

    assert fit_devices(SimpleNamespace(world_size=world, dims=ParallelDims(dp=dp, tp=tp, pp=pp)), gpus) == fit


def test_verify_twin_runs_here_with_the_local_launcher():
    from hybridtrain.verify import overrides, shrink

    cfg = compose("+recipe=llama_7b", "launcher=slurm")
    plan, hf = resolve(cfg, Machine(gpus_per_node=0, cpu_cores=2))
    args = overrides(cfg, shrink(cfg, plan, hf, 2), {"dp": 1}, on_cpu=True)
    assert "launcher=local" in args and "launcher.nodes=1" in args and "launcher.gpus=false" in args
    assert "launcher.gpus_per_node=null" in args


@pytest.mark.parametrize("gpus,visible", [(False, ""), (None, "0,1"), (True, "0,1")])
def test_cpu_processes_on_a_gpu_machine_see_no_gpu(gpus, visible):
    """``launcher.gpus=false`` on a machine with 8 GPUs: the local launcher's ranks get
    ``CUDA_VISIBLE_DEVICES=""`` (before, ``0,1``: DeepSpeed then trained on the GPUs with a plan made for CPU
    processes); with GPUs they keep theirs."""
    from hybridtrain.launch.devices import rank_devices

    cfg = compose("+recipe=gpt_tiny", "parallel.dp=2", "launcher.gpus=" + ("null" if gpus is None else str(gpus).lower()))
    machine = Machine(gpus_per_node=8, cpu_cores=16, device_memory_bytes=80 << 30)
    ranks = [local_rank_env({}, r, 2, 1234, rank_devices(cfg.launcher, machine, 2, {})) for r in range(2)]
    assert [e["CUDA_VISIBLE_DEVICES"] for e in ranks] == [visible] * 2
    if gpus is False:  # 12 CPU processes where 2 GPUs are shown: nothing to refuse
        assert rank_devices(cfg.launcher, machine, 12, {"CUDA_VISIBLE_DEVICES": "0,1"}) == []


def test_a_cpu_rank_hides_the_gpus_its_launcher_listed():
    """``launcher=multinode``: DeepSpeed's ``launcher/launch.py`` sets ``CUDA_VISIBLE_DEVICES`` to the node's slots
    for every accelerator, the CPU one included; the rank of a CPU-process job (``DS_ACCELERATOR=cpu``, from
    :func:`cpu_ranks_env`) hides them again before torch looks for CUDA."""
    from deepspeed.accelerator.cpu_accelerator import CPU_Accelerator

    from hybridtrain.launch.devices import cpu_ranks_env, hide_gpus

    env = dict(cpu_ranks_env(gpus=False))
    CPU_Accelerator().set_visible_devices_envs(env, [0, 1])  # what launch.py does on each node
    assert env["CUDA_VISIBLE_DEVICES"] == "0,1"
    hide_gpus(env)
    assert env["CUDA_VISIBLE_DEVICES"] == "" and env["DS_ACCELERATOR"] == "cpu"
    gpu = {"CUDA_VISIBLE_DEVICES": "0,1", **cpu_ranks_env(gpus=True)}  # a GPU job's rank keeps its devices
    hide_gpus(gpu)
    assert gpu == {"CUDA_VISIBLE_DEVICES": "0,1"}
