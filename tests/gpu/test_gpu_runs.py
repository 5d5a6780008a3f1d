"""GPU tier: real runs on CUDA devices with NCCL (``tests/conftest.py`` skips this folder without CUDA).

Run with the GPUs visible: ``HYBRIDTRAIN_TEST_GPU=1 python -m pytest -q tests/gpu`` (``scripts/gpu_check.sh``
runs what fits on one GPU and records it under ``bench/results/``). Tests that need more GPUs than the
machine has skip and say how many. fp32 comparisons turn TF32 off (``trainer.tf32=false``), so they
hold the fp32 tolerances of ``tests/dist/test_parity.py``.
"""
from __future__ import annotations

import json
import os
import subprocess
import sys

import pytest
import torch

from helpers.launch import REPO, losses, metrics, run_cli

SHORT = ["trainer.max_steps=4", "optim.warmup_steps=1", "trainer.save_final=false"]
CPU = {"CUDA_VISIBLE_DEVICES": ""}


def need_gpus(n: int) -> None:
    have = torch.cuda.device_count()
    if have < n:
        pytest.skip(f"needs {n} GPUs (NCCL runs one rank per GPU); this machine has {have}")


def _close(got: list[float], want: list[float], rel: float) -> None:
    assert len(got) == len(want) and all(abs(g - w) <= rel * abs(w) for g, w in zip(got, want)), (got, want)


TINY = ["+recipe=gpt_tiny", "++model.config.vocab_size=8003", "trainer.precision=fp32", *SHORT]  # 8003 rows: padded on GPUs only


@pytest.fixture(scope="module")
def cpu_reference(tmp_path_factory):
    """The same run as CPU processes (GPUs hidden): the fp32 reference."""
    run_dir = tmp_path_factory.mktemp("cpu")
    run_cli(run_dir, *TINY, env=CPU)
    return run_dir


def test_fp32_on_a_gpu_trains_like_the_cpu_and_pads_the_vocabulary_to_64(tmp_path, cpu_reference):
    """One GPU against CPU processes, TF32 off: the same losses (fp32 tolerance) although the GPU run
    pads the vocabulary to a multiple of 64 (masked) and the CPU run does not; GPU-only metrics appear."""
    need_gpus(1)
    run_cli(tmp_path, *TINY, "trainer.tf32=false")
    gpu_plan = json.loads((tmp_path / "plan.json").read_text())
    cpu_plan = json.loads((cpu_reference / "plan.json").read_text())
    assert gpu_plan["padded_vocab_size"] == 8064 and cpu_plan["padded_vocab_size"] == 8003
    _close(losses(tmp_path), losses(cpu_reference), 1e-4)
    last = metrics(tmp_path)[-1]
    assert last["rank_gpu_peak_bytes"][0] > 0 and last["mfu"] is not None and 0 < last["mfu"] < 1
    assert sum(last["stage_forward_s"]) > 0 and sum(last["stage_backward_s"]) > 0  # CUDA-event spans
    observe = json.loads((tmp_path / "observe.json").read_text())
    assert observe["device"] != "cpu" and observe["peak_source"].endswith(" fp32")


def test_tf32_is_the_default_and_its_peak_is_used(tmp_path, cpu_reference):
    need_gpus(1)
    run_cli(tmp_path, *TINY)
    observe = json.loads((tmp_path / "observe.json").read_text())
    assert observe["peak_source"].endswith(" tf32"), observe["peak_source"]
    _close(losses(tmp_path), losses(cpu_reference), 1e-2)  # TF32: 10-bit mantissa products


def test_a_gpu_run_trains_in_bf16_by_default_against_the_bf16_peak(tmp_path):
    """``trainer.precision: null`` on GPUs is bf16 (plan/devices.py precision_for); MFU uses the bf16 peak."""
    need_gpus(1)
    run_cli(tmp_path, "+recipe=gpt_tiny", *SHORT)
    plan = json.loads((tmp_path / "plan.json").read_text())
    observe = json.loads((tmp_path / "observe.json").read_text())
    assert plan["precision"] == "bf16" and plan["zero_stage"] == 1
    assert observe["peak_source"].endswith(" bf16"), observe["peak_source"]


def test_bf16_checkpoint_resumes_exactly_exports_and_keeps_the_cuda_rng(tmp_path):
    """bf16 ZeRO-1 (DeepSpeed's BF16 optimizer) on one GPU: checkpoint collectives on the device,
    exact resume, the HF export matching hybridtrain's logits, the CUDA RNG state saved."""
    need_gpus(1)
    full = tmp_path / "full"
    common = ["+recipe=llama_tiny", "trainer.precision=bf16", "trainer.max_steps=4", "optim.warmup_steps=1"]
    run_cli(full, *common, "trainer.save_every=2", "trainer.save_logits=true", "trainer.export_hf=true")
    step2 = full / "checkpoints" / "step_2"
    from hybridtrain.checkpoint.io import CheckpointDir
    from hybridtrain.checkpoint.save import load_rng

    assert "cuda" in load_rng(CheckpointDir(step2).rng_file(0))[0]  # safetensors: the CUDA generator's state too
    run_cli(tmp_path / "resumed", *common, f"trainer.resume={step2}")
    _close(losses(tmp_path / "resumed"), losses(full)[2:], 5e-3)  # GPU kernels are not bit-deterministic
    proc = subprocess.run([sys.executable, "-m", "hybridtrain.export", str(step2), str(tmp_path / "hf"), "--check"],
                          cwd=REPO, capture_output=True, text=True, timeout=300)
    assert proc.returncode == 0 and "check passed" in proc.stdout, proc.stdout + proc.stderr
    assert (full / "hf" / "config.json").is_file()  # the end-of-run export, after the final barrier


def test_tp2_checkpoint_save_and_resume(tmp_path):
    """tp = 2 over NCCL: the checkpoint gathers tensor-parallel shards on the device (it crashed when
    they were host tensors), resumes exactly, and re-shards to tp = 1."""
    need_gpus(2)
    full = tmp_path / "full"
    common = ["+recipe=gpt_tiny", "trainer.tf32=false", "trainer.max_steps=4", "optim.warmup_steps=1"]
    run_cli(full, *common, "parallel.tp=2", "trainer.save_every=2")
    step2 = full / "checkpoints" / "step_2"
    run_cli(tmp_path / "same", *common, "parallel.tp=2", f"trainer.resume={step2}")
    _close(losses(tmp_path / "same"), losses(full)[2:], 1e-5)
    run_cli(tmp_path / "tp1", *common, "parallel.tp=1", f"trainer.resume={step2}")
    _close(losses(tmp_path / "tp1"), losses(full)[2:], 1e-4)


def test_bf16_zero1_pipeline_save_and_resume(tmp_path):
    need_gpus(2)
    full = tmp_path / "full"
    common = ["+recipe=gpt_tiny", "trainer.precision=bf16", "trainer.max_steps=4", "optim.warmup_steps=1"]
    run_cli(full, *common, "parallel.pp=2", "trainer.save_every=2")
    step2 = full / "checkpoints" / "step_2"
    run_cli(tmp_path / "same", *common, "parallel.pp=2", f"trainer.resume={step2}")
    _close(losses(tmp_path / "same"), losses(full)[2:], 5e-3)
    run_cli(tmp_path / "pp1", *common, "parallel.pp=1", f"trainer.resume={step2}")
    _close(losses(tmp_path / "pp1"), losses(full)[2:], 2e-2)


def test_fp32_zero0_tp2_pp4_with_a_tied_head_trains_like_one_gpu(tmp_path):
    """The last stage [final_norm, head] of llama_tiny tp=2 pp=4 holds only replicated and tied
    parameters: TP rank 1 has no gradient of its own for the norm (engine/clip.py)."""
    need_gpus(8)
    common = ["+recipe=llama_tiny", "trainer.precision=fp32", "trainer.tf32=false", *SHORT]
    run_cli(tmp_path / "plan", *common, "parallel.tp=2", "parallel.pp=4", "parallel.zero_stage=0", "parallel.dp=1")
    run_cli(tmp_path / "single", *common)
    got, want = metrics(tmp_path / "plan"), metrics(tmp_path / "single")
    _close([m["loss"] for m in got], [m["loss"] for m in want], 1e-4)
    _close([m["grad_norm"] for m in got], [m["grad_norm"] for m in want], 1e-3)


def test_parallel_auto_in_bf16_picks_a_plan_that_trains(tmp_path):
    need_gpus(1)
    proc = run_cli(tmp_path, "+recipe=gpt_tiny", "parallel=auto", "trainer.precision=bf16", *SHORT)
    plan = json.loads((tmp_path / "plan.json").read_text())
    assert plan["world_size"] == torch.cuda.device_count() and plan["zero_stage"] >= 1, proc.stdout[-2000:]
    assert len(metrics(tmp_path)) == 4


def test_verify_on_a_node_smaller_than_the_plan(tmp_path):
    need_gpus(1)
    dp = torch.cuda.device_count() + 1  # one replica more than this node has GPUs
    proc = subprocess.run([sys.executable, "-m", "hybridtrain.verify", "+recipe=gpt_tiny", f"parallel.dp={dp}",
                           f"launcher.gpus_per_node={dp}", "--steps", "2", "--out", str(tmp_path)],
                          cwd=REPO, capture_output=True, text=True, timeout=600)
    assert proc.returncode == 0 and "OK, the plan trains like one process" in proc.stdout, proc.stdout + proc.stderr
    assert "do not fit this machine's GPUs" in proc.stdout


def test_cuda_visible_devices_is_honoured(tmp_path):
    """A rank started under CUDA_VISIBLE_DEVICES=K trains on GPU K (the controller passes the user's list
    on; tests/unit/test_devices.py pins the mapping)."""
    need_gpus(1)
    last = str(torch.cuda.device_count() - 1)
    proc = run_cli(tmp_path, "+recipe=gpt_tiny", "trainer.max_steps=1", "trainer.save_final=false",
                   env={"CUDA_VISIBLE_DEVICES": last})
    assert proc.returncode == 0 and "launching 1 rank(s)" in proc.stdout, proc.stdout + proc.stderr


def test_single_gpu_mfu_benchmark(tmp_path):
    """bench/gpu_mfu.py, shortened: hybridtrain and a plain transformers loop on a 0.9B Llama in bf16."""
    need_gpus(1)
    proc = subprocess.run([sys.executable, str(REPO / "bench" / "gpu_mfu.py"), "--rounds", "1", "--steps", "4",
                           "--out", str(tmp_path)], cwd=REPO, capture_output=True, text=True, timeout=900,
                          env=dict(os.environ, PYTHONPATH=str(REPO)))
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    result = json.loads(next(tmp_path.glob("gpu_mfu_*.json")).read_text())
    for side in ("hybridtrain", "plain"):
        assert result[side]["mfu"] is None or 0 < result[side]["mfu"] < 1, result[side]
    assert result["hybridtrain"]["tokens_per_s"] > 0.5 * result["plain"]["tokens_per_s"], result
