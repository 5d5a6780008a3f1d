"""GPU tier, one GPU: the parts a green check must cover since the third review (gpu-review-3 finding 12): an MoE
model (CUDA's grouped GEMM, the dispatch's counting, the router aux loss) against its CPU run, the loss in pieces
below the micro-batch size, and the GPU's peak allocated memory against the plan's estimate.

Tolerances as in ``test_gpu_runs.py``: fp32 with TF32 off against CPU processes 1e-4 (other summation orders
agree to about 1e-6; the twin's routers have a clear top-k margin, ``helpers/moe.py``, so no choice flips);
bf16 against fp32 3e-2.
"""
from __future__ import annotations

import math

import pytest
import torch

from helpers.launch import losses, metrics, run_cli
from helpers.moe import make_moe_checkpoint, moe_overrides

CPU = {"CUDA_VISIBLE_DEVICES": ""}
FP32 = ["trainer.precision=fp32", "trainer.tf32=false"]
STEPS = 4


def _need_gpu() -> None:
    if not torch.cuda.is_available():
        pytest.skip("needs a CUDA GPU")


def _close(got: list[float], want: list[float], rel: float) -> None:
    assert len(got) == len(want) and all(math.isfinite(g) for g in got), (got, want)
    assert all(abs(g - w) <= rel * abs(w) for g, w in zip(got, want)), (got, want, rel)


def _norms(run_dir) -> list[float]:
    return [m["grad_norm"] for m in metrics(run_dir) if "loss" in m]


@pytest.fixture(scope="module")
def twin(tmp_path_factory):
    """The Qwen3-MoE twin (8 experts, top-2, aux loss on; hidden 64 and expert width 32: the 16-byte alignment
    CUDA's grouped GEMM checks holds) and its fp32 run as CPU processes, the reference."""
    _need_gpu()
    folder = make_moe_checkpoint(tmp_path_factory.mktemp("moe") / "qwen3_moe", "qwen3_moe")
    cpu = tmp_path_factory.mktemp("moe_cpu")
    run_cli(cpu, *moe_overrides(folder, STEPS), *FP32, env=CPU)
    return folder, cpu


def test_an_moe_twin_in_fp32_on_a_gpu_trains_like_the_cpu(twin, tmp_path):
    """CUDA's grouped GEMM (fp32: torch's fallback, one matmul per expert), the routers and the aux loss, TF32
    off: the CPU run's losses (which carry the aux loss) to 1e-4 and its gradient norms to 1e-3."""
    folder, cpu = twin
    run_cli(tmp_path, *moe_overrides(folder, STEPS), *FP32)
    _close(losses(tmp_path), losses(cpu), 1e-4)
    _close(_norms(tmp_path), _norms(cpu), 1e-3)


def test_an_moe_twin_in_bf16_on_a_gpu_trains_within_bf16_of_the_cpu(twin, tmp_path):
    """bf16 (on sm90+ torch's CUTLASS grouped GEMM, no host sync): within 3e-2 of the fp32 CPU run."""
    folder, cpu = twin
    run_cli(tmp_path, *moe_overrides(folder, STEPS), "trainer.precision=bf16")
    _close(losses(tmp_path), losses(cpu), 3e-2)


GPT_TINY = ["+recipe=gpt_tiny", f"trainer.max_steps={STEPS}", "optim.warmup_steps=1", "trainer.save_final=false",
            "model.attn_implementation=eager", *FP32]


def test_the_loss_in_pieces_below_the_micro_batch_equals_the_whole_loss_on_a_gpu(tmp_path):
    """``trainer.loss_chunk_tokens=8`` under a micro-batch of 32 tokens (4 pieces through the head and the loss,
    the head's backward per piece) against the whole loss: the same losses (1e-5) and gradient norms (1e-4)."""
    _need_gpu()
    run_cli(tmp_path / "whole", *GPT_TINY)
    run_cli(tmp_path / "pieces", *GPT_TINY, "trainer.loss_chunk_tokens=8")
    _close(losses(tmp_path / "pieces"), losses(tmp_path / "whole"), 1e-5)
    _close(_norms(tmp_path / "pieces"), _norms(tmp_path / "whole"), 1e-4)


LLAMA = ["+recipe=llama_tiny", "model.config.hidden_size=1024", "model.config.intermediate_size=2816",
         "model.config.num_hidden_layers=8", "model.config.num_attention_heads=16", "model.config.num_key_value_heads=8",
         "model.config.max_position_embeddings=1024", "data.seq_len=512", "parallel.micro_batch_size=4",
         "trainer.global_batch_size=8", "trainer.max_steps=3", "optim.warmup_steps=1", "trainer.save_final=false",
         "trainer.precision=bf16"]
MOE_WIDE = dict(hidden_size=1024, moe_intermediate_size=512, intermediate_size=2048, num_hidden_layers=4,
                num_attention_heads=16, num_key_value_heads=8, head_dim=64, max_position_embeddings=1024)


@pytest.mark.parametrize("model", ["llama_dense", "qwen3_moe"])
def test_the_gpus_peak_memory_is_the_plans_estimate(model, tmp_path):
    """``torch.cuda.max_memory_allocated`` of the rank (``rank_gpu_peak_bytes``, after the first step) against the
    plan's estimate for the run (``plan.estimate.estimate_for_run``: parameters, gradients, optimizer state,
    activations, reduction buffer), within 10%: a dense Llama of 0.1B parameters and an MoE of 8 experts, bf16,
    rows of 512 tokens, large enough that CUDA's fixed costs (cuBLAS workspaces) are a few percent."""
    _need_gpu()
    from hybridtrain.plan.estimate import estimate_for_run

    if model == "llama_dense":
        run_cli(tmp_path / "run", *LLAMA)
    else:
        folder = make_moe_checkpoint(tmp_path / "moe", "qwen3_moe", **MOE_WIDE)
        run_cli(tmp_path / "run", *moe_overrides(folder, 3), "data.seq_len=512", "parallel.micro_batch_size=4",
                "trainer.global_batch_size=8", "trainer.save_final=false", "trainer.precision=bf16")
    peak = max(p for m in metrics(tmp_path / "run") if "loss" in m for p in m["rank_gpu_peak_bytes"] if p)
    estimate = estimate_for_run(tmp_path / "run").total
    assert abs(peak - estimate) <= 0.1 * peak, (f"{model}: the GPU's peak {peak / 2**30:.3f} GiB, the plan's "
                                                f"estimate {estimate / 2**30:.3f} GiB")
