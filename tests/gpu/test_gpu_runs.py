"""GPU tier: real runs on CUDA devices with NCCL (``tests/conftest.py`` skips this folder without CUDA).

Run with the GPUs visible: ``HYBRIDTRAIN_TEST_GPU=1 python -m pytest -q tests/gpu`` (``scripts/gpu_check.sh``
runs what fits on one GPU and records each verdict under ``bench/results/``). Tests that need more GPUs than
the machine has skip and say how many.

Every comparison states its tolerance from the precision it runs in, and every run's losses must be finite:

- fp32 with TF32 off (``trainer.tf32=false``) wherever a run is compared with CPU processes or with another
  layout: fp32 rounds at 6e-8 relative, so GPU and CPU kernels (other summation orders) agree to about 1e-6
  on these 4-step losses; 1e-4 (the CPU parity suite's fp32 tolerance, ``hybridtrain/verify.py``) is 100x
  that and 50x below one training step's loss change (2-3% on the tiny recipes).
- Same-plan resumes use eager attention (no atomics in its backward, unlike sdpa's fused kernels), so the
  resumed steps repeat the same kernels on the same data: expected bit-identical, held to 1e-5 in fp32
  and 1e-3 in bf16 (a few bf16 roundings of 4e-3 in one rank's weights, should cuBLAS pick other
  algorithms in the new process). A resume that lost the scheduler's state takes a 30% larger step 3
  (lr 3e-3 instead of 2.3e-3 after one warm-up step), about 0.7% of the loss (steps move it 2-3%: 9.03,
  8.88, 8.62, 8.46 for llama_tiny bf16 on CPU); one from the initial weights is 5% off.
- bf16 against fp32: 3e-2 (``verify``'s bf16 tolerance, 8 bf16 roundings).
"""
from __future__ import annotations

import json
import math
import os
import subprocess
import sys
from pathlib import Path

import pytest
import torch

from helpers.launch import REPO, losses, metrics, run_cli

SHORT = ["trainer.max_steps=4", "optim.warmup_steps=1", "trainer.save_final=false"]
CPU = {"CUDA_VISIBLE_DEVICES": ""}
FP32 = ["trainer.precision=fp32", "trainer.tf32=false"]
EXACT = ["model.attn_implementation=eager"]  # deterministic backward: a same-plan resume repeats its kernels


def need_gpus(n: int) -> None:
    have = torch.cuda.device_count()
    if have < n:
        pytest.skip(f"needs {n} GPUs (NCCL runs one rank per GPU); this machine has {have}")


def _finite(values: list[float], n: int) -> list[float]:
    """``values`` (a run's losses or gradient norms), asserted to be ``n`` finite numbers."""
    assert len(values) == n and all(v is not None and math.isfinite(v) for v in values), values
    return values


def _close(got: list[float], want: list[float], rel: float) -> None:
    """Equal length, finite, and each within ``rel`` of ``want`` (relative)."""
    _finite(got, len(want))
    _finite(want, len(got))
    assert all(abs(g - w) <= rel * abs(w) for g, w in zip(got, want)), (got, want, rel)


def _norms(run_dir: Path) -> list[float]:
    """The gradient norm of every logged training step."""
    return [m["grad_norm"] for m in metrics(run_dir) if "loss" in m]


TINY = ["+recipe=gpt_tiny", "++model.config.vocab_size=8003", *SHORT]  # 8003 rows: padded on GPUs only


@pytest.fixture(scope="module")
def cpu_reference(tmp_path_factory):
    """The fp32 run as CPU processes (GPUs hidden): the reference."""
    run_dir = tmp_path_factory.mktemp("cpu")
    run_cli(run_dir, *TINY, *FP32, env=CPU)
    return run_dir


@pytest.fixture(scope="module")
def gpu_fp32(tmp_path_factory):
    """The same run on one GPU, fp32 with TF32 off."""
    need_gpus(1)
    run_dir = tmp_path_factory.mktemp("gpu_fp32")
    run_cli(run_dir, *TINY, *FP32)
    return run_dir


@pytest.mark.xdist_group("reference")
def test_fp32_on_a_gpu_trains_like_the_cpu_and_pads_the_vocabulary_to_64(gpu_fp32, cpu_reference):
    """One GPU against CPU processes, TF32 off: the same losses and gradient norms (fp32: 1e-4, see the
    module's docstring) although the GPU run pads the vocabulary to a multiple of 64 (masked) and the CPU
    run does not; GPU-only metrics appear."""
    gpu_plan = json.loads((gpu_fp32 / "plan.json").read_text())
    cpu_plan = json.loads((cpu_reference / "plan.json").read_text())
    assert gpu_plan["padded_vocab_size"] == 8064 and cpu_plan["padded_vocab_size"] == 8003
    _close(losses(gpu_fp32), losses(cpu_reference), 1e-4)
    _close(_norms(gpu_fp32), _norms(cpu_reference), 1e-3)
    last = metrics(gpu_fp32)[-1]
    assert last["rank_gpu_peak_bytes"][0] > 0 and last["mfu"] is not None and 0 < last["mfu"] < 1
    assert sum(last["stage_forward_s"]) > 0 and sum(last["stage_backward_s"]) > 0  # CUDA-event spans
    observe = json.loads((gpu_fp32 / "observe.json").read_text())
    assert observe["device"] != "cpu" and observe["peak_source"].endswith(" fp32")


@pytest.mark.xdist_group("reference")
def test_tf32_is_the_default_and_its_peak_is_used(tmp_path, cpu_reference):
    """``trainer.tf32`` left at its default: the fp32 run's matmuls use TF32 (10-bit mantissas, rounding at
    5e-4), so the first step's gradient norm differs from the same run's with ``trainer.tf32=false`` by more
    than fp32's own rounding (1e-7 relative), while two runs with TF32 off give the same norm to 1e-9: eager
    attention in all three (sdpa's memory-efficient backward is not deterministic from run to run, which alone
    made two runs differ: gpu-review-3 finding 13). The losses stay within 1e-2 of the CPU's; MFU is against
    the TF32 peak."""
    need_gpus(1)
    on, off, again = tmp_path / "tf32", tmp_path / "off", tmp_path / "off_again"
    run_cli(on, *TINY, *EXACT, "trainer.precision=fp32")
    for run_dir in (off, again):
        run_cli(run_dir, *TINY, *EXACT, *FP32)
    observe = json.loads((on / "observe.json").read_text())
    assert observe["peak_source"].endswith(" tf32"), observe["peak_source"]
    _close(losses(on), losses(cpu_reference), 1e-2)
    tf32, fp32, fp32_again = (_norms(d)[0] for d in (on, off, again))
    assert abs(fp32 - fp32_again) <= 1e-9 * abs(fp32), (fp32, fp32_again)  # the kernels repeat exactly
    assert abs(tf32 - fp32) > 1e-7 * abs(fp32), (tf32, fp32)  # TF32 changed the matmuls: it is on


def test_a_gpu_run_trains_in_bf16_by_default_against_the_bf16_peak(tmp_path):
    """``trainer.precision: null`` on GPUs is bf16 (plan/devices.py precision_for); MFU uses the bf16 peak."""
    need_gpus(1)
    run_cli(tmp_path, "+recipe=gpt_tiny", *SHORT)
    plan = json.loads((tmp_path / "plan.json").read_text())
    observe = json.loads((tmp_path / "observe.json").read_text())
    assert plan["precision"] == "bf16" and plan["zero_stage"] == 1
    assert observe["peak_source"].endswith(" bf16"), observe["peak_source"]
    _finite(losses(tmp_path), 4)


BF16_EXPORT_TOLERANCE = 3e-2
"""``export --check`` of a bf16 run: hybridtrain's saved logits were computed in bf16 (bf16 weights and
activations), transformers' from the fp32 master weights. On CPU the two differ by 4.7e-3 of the largest
logit (llama_tiny, step 2: 0.0054 of 1.16), about one bf16 rounding (3.9e-3); 3e-2 is 6x that, while a
conversion error (a permuted or missing tensor) differs by the logits' own size. fp32's 1e-5, the
command's default, cannot pass in bf16."""


def test_bf16_checkpoint_resumes_exactly_exports_and_keeps_the_cuda_rng(tmp_path):
    """bf16 ZeRO-1 (DeepSpeed's BF16 optimizer) on one GPU: checkpoint collectives on the device,
    the same-plan resume (1e-3: see the module's docstring), the HF export matching hybridtrain's logits
    (:data:`BF16_EXPORT_TOLERANCE`), the CUDA RNG state saved."""
    need_gpus(1)
    full = tmp_path / "full"
    common = ["+recipe=llama_tiny", "trainer.precision=bf16", "trainer.max_steps=4", "optim.warmup_steps=1", *EXACT]
    run_cli(full, *common, "trainer.save_every=2", "trainer.save_logits=true", "trainer.export_hf=true")
    step2 = full / "checkpoints" / "step_2"
    from hybridtrain.checkpoint.io import CheckpointDir
    from hybridtrain.checkpoint.save import load_rng

    assert "cuda" in load_rng(CheckpointDir(step2).rng_file(0))[0]  # safetensors: the CUDA generator's state too
    run_cli(tmp_path / "resumed", *common, f"trainer.resume={step2}")
    _close(losses(tmp_path / "resumed"), _finite(losses(full), 4)[2:], 1e-3)
    proc = subprocess.run([sys.executable, "-m", "hybridtrain.export", str(step2), str(tmp_path / "hf"), "--check",
                           "--tolerance", str(BF16_EXPORT_TOLERANCE)],
                          cwd=REPO, capture_output=True, text=True, timeout=300)
    assert proc.returncode == 0 and "check passed" in proc.stdout, proc.stdout + proc.stderr
    assert (full / "hf" / "config.json").is_file()  # the end-of-run export, after the final barrier


def test_tp2_checkpoint_save_and_resume(tmp_path):
    """tp = 2 over NCCL in fp32 (TF32 off): the checkpoint gathers tensor-parallel shards on the device (it
    crashed when they were host tensors), resumes exactly under the same plan (1e-5) and re-shards to
    tp = 1 (1e-4: other summation orders; see the module's docstring)."""
    need_gpus(2)
    full = tmp_path / "full"
    common = ["+recipe=gpt_tiny", *FP32, *EXACT, "trainer.max_steps=4", "optim.warmup_steps=1"]
    run_cli(full, *common, "parallel.tp=2", "trainer.save_every=2")
    step2 = full / "checkpoints" / "step_2"
    want = _finite(losses(full), 4)[2:]
    run_cli(tmp_path / "same", *common, "parallel.tp=2", f"trainer.resume={step2}")
    _close(losses(tmp_path / "same"), want, 1e-5)
    run_cli(tmp_path / "tp1", *common, "parallel.tp=1", f"trainer.resume={step2}")
    _close(losses(tmp_path / "tp1"), want, 1e-4)


def test_bf16_zero1_pipeline_save_and_resume(tmp_path):
    """bf16 ZeRO-1 at pp = 2: the same-plan resume (1e-3) and the re-shard to pp = 1, which runs other bf16
    roundings (2e-2, as the CPU tier's ``test_bf16_pipeline_checkpoint_resumes_exactly_and_reshards``:
    it tells the checkpoint's weights from the initial ones, 5% apart, not a lost moment)."""
    need_gpus(2)
    full = tmp_path / "full"
    common = ["+recipe=gpt_tiny", "trainer.precision=bf16", *EXACT, "trainer.max_steps=4", "optim.warmup_steps=1"]
    run_cli(full, *common, "parallel.pp=2", "trainer.save_every=2")
    step2 = full / "checkpoints" / "step_2"
    want = _finite(losses(full), 4)[2:]
    run_cli(tmp_path / "same", *common, "parallel.pp=2", f"trainer.resume={step2}")
    _close(losses(tmp_path / "same"), want, 1e-3)
    run_cli(tmp_path / "pp1", *common, "parallel.pp=1", f"trainer.resume={step2}")
    _close(losses(tmp_path / "pp1"), want, 2e-2)


def test_fp32_zero0_tp2_pp4_with_a_tied_head_trains_like_one_gpu(tmp_path):
    """The last stage [final_norm, head] of llama_tiny tp=2 pp=4 holds only replicated and tied
    parameters: TP rank 1 has no gradient of its own for the norm (engine/clip.py). fp32, TF32 off: 1e-4."""
    need_gpus(8)
    common = ["+recipe=llama_tiny", *FP32, *SHORT]
    run_cli(tmp_path / "plan", *common, "parallel.tp=2", "parallel.pp=4", "parallel.zero_stage=0", "parallel.dp=1")
    run_cli(tmp_path / "single", *common)
    _close(losses(tmp_path / "plan"), losses(tmp_path / "single"), 1e-4)
    _close(_norms(tmp_path / "plan"), _norms(tmp_path / "single"), 1e-3)


def test_parallel_auto_in_bf16_picks_a_plan_that_trains(tmp_path):
    need_gpus(1)
    proc = run_cli(tmp_path, "+recipe=gpt_tiny", "parallel=auto", "trainer.precision=bf16", *SHORT)
    plan = json.loads((tmp_path / "plan.json").read_text())
    assert plan["world_size"] == torch.cuda.device_count() and plan["zero_stage"] >= 1, proc.stdout[-2000:]
    _finite(losses(tmp_path), 4)


def _verify(tmp_path: Path, *overrides: str) -> str:
    proc = subprocess.run([sys.executable, "-m", "hybridtrain.verify", "+recipe=gpt_tiny", *overrides,
                           "--steps", "2", "--out", str(tmp_path)],
                          cwd=REPO, capture_output=True, text=True, timeout=600)
    assert proc.returncode == 0 and "OK, the plan trains like one process" in proc.stdout, proc.stdout + proc.stderr
    return proc.stdout


def test_verify_on_a_node_smaller_than_one_replica_runs_the_twin_as_cpu_processes(tmp_path):
    """A tp = 2 dp = 2 plan for 4 GPUs on a machine with fewer than 2: one replica does not fit, so verify
    runs the twin, still tp = 2 dp = 2, and the one-process run as CPU processes on this GPU machine and
    compares them (its bf16 tolerance: the plan made for GPUs is bf16)."""
    need_gpus(1)
    if torch.cuda.device_count() >= 2:
        pytest.skip("needs a machine with 1 GPU (one tp = 2 replica must not fit)")
    out = _verify(tmp_path, "parallel.tp=2", "parallel.dp=2", "launcher.gpus_per_node=4")
    assert "do not fit this machine's GPUs: the twin runs as CPU processes" in out, out
    assert "plan dp=2 tp=2 pp=1" in out, out
    _finite(losses(tmp_path / "plan"), 2)


def test_verify_on_a_node_smaller_than_the_plan_drops_replicas(tmp_path):
    """A tp = 2 plan with one replica more than this node holds: verify's twin keeps tp = 2 on the GPUs
    with fewer replicas and compares it with one process (a comparison of two layouts, unlike a one-GPU
    machine, where the twin would be the one-process run itself)."""
    need_gpus(2)
    have = torch.cuda.device_count()
    dp = have // 2 + 1
    out = _verify(tmp_path, "parallel.tp=2", f"parallel.dp={dp}", f"launcher.gpus_per_node={2 * dp}")
    assert f"do not fit this machine's GPUs: the twin runs dp={have // 2}" in out, out
    assert f"plan dp={have // 2} tp=2 pp=1" in out, out


ONE_STEP = ["+recipe=gpt_tiny", "trainer.max_steps=1", "optim.warmup_steps=1", "trainer.save_final=false"]


def _gpu_uuid(run_dir: Path) -> str:
    return json.loads((run_dir / "observe.json").read_text())["gpu_uuid"]


def test_a_gpu_uuid_in_cuda_visible_devices_is_honoured(tmp_path):
    """``CUDA_VISIBLE_DEVICES=GPU-<uuid>`` (the form SLURM and MIG setups give): the controller passes the
    entry on as it is (``launch/devices.py`` local_devices) and the rank trains on that GPU, which reports
    the same UUID (``observe.json`` ``gpu_uuid``)."""
    need_gpus(1)
    uuid = str(torch.cuda.get_device_properties(torch.cuda.device_count() - 1).uuid)
    name = uuid if uuid.startswith(("GPU-", "MIG-")) else f"GPU-{uuid}"
    proc = run_cli(tmp_path, *ONE_STEP, env={"CUDA_VISIBLE_DEVICES": name})
    assert "launching 1 rank(s)" in proc.stdout, proc.stdout + proc.stderr
    assert _gpu_uuid(tmp_path).removeprefix("GPU-") == uuid.removeprefix("GPU-")
    _finite(losses(tmp_path), 1)


def test_cuda_visible_devices_index_is_honoured(tmp_path):
    """A rank started under ``CUDA_VISIBLE_DEVICES=K`` (K the last GPU, not 0) trains on GPU K
    (tests/unit/test_devices.py pins the mapping): it reports GPU K's UUID."""
    need_gpus(2)
    last = torch.cuda.device_count() - 1
    run_cli(tmp_path, *ONE_STEP, env={"CUDA_VISIBLE_DEVICES": str(last)})
    want = str(torch.cuda.get_device_properties(last).uuid).removeprefix("GPU-")
    assert _gpu_uuid(tmp_path).removeprefix("GPU-") == want
    _finite(losses(tmp_path), 1)


def test_single_gpu_mfu_benchmark(tmp_path):
    """bench/gpu_mfu.py, shortened: hybridtrain and a plain transformers loop on a 0.9B Llama in bf16, both
    with finite losses; hybridtrain's throughput at least half the plain loop's. ``HYBRIDTRAIN_GPU_RESULTS``
    (set by scripts/gpu_check.sh) keeps its results."""
    need_gpus(1)
    out = Path(os.environ.get("HYBRIDTRAIN_GPU_RESULTS") or tmp_path)
    proc = subprocess.run([sys.executable, str(REPO / "bench" / "gpu_mfu.py"), "--rounds", "1", "--steps", "4",
                           "--out", str(out)], cwd=REPO, capture_output=True, text=True, timeout=900,
                          env=dict(os.environ, PYTHONPATH=os.pathsep.join(
                              p for p in (str(REPO), os.environ.get("PYTHONPATH", "")) if p)))
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    result = json.loads(max(out.glob("gpu_mfu_2*.json")).read_text())
    for side in ("hybridtrain", "plain"):
        assert result[side]["mfu"] is None or 0 < result[side]["mfu"] < 1, result[side]
        assert result[side]["losses_finite"] is True, result[side]
    assert result["hybridtrain"]["tokens_per_s"] > 0.5 * result["plain"]["tokens_per_s"], result
