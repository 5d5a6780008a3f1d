"""The command line on a machine without CUDA: a job that asked for GPUs stops before launching."""
from __future__ import annotations

import pytest

from helpers.launch import run_cli


def test_gpus_asked_on_a_machine_without_cuda_exits_2_before_launching(tmp_path):
    proc = run_cli(tmp_path, "+recipe=gpt_tiny", "launcher.gpus=true", check=False, timeout=300)
    assert proc.returncode == 2, proc.stdout[-3000:] + proc.stderr[-3000:]
    assert "config error: launcher.gpus: launcher.gpus=true but torch" in proc.stderr
    assert "Traceback" not in proc.stderr and "launching" not in proc.stdout
    assert not (tmp_path / "config.yaml").exists()  # nothing prepared, nothing started


@pytest.mark.slow  # two runs and a re-shard; CI re-shards on resume in test_checkpoint.py
def test_checkpoint_with_the_gpu_vocabulary_padding_resumes_on_cpu(tmp_path):
    """A GPU run pads the vocabulary to 64 x tp rows, a CPU run to tp: resuming one's checkpoint on
    the other goes through the HF names (re-shard) and continues the losses."""
    from helpers.launch import losses

    common = ["+recipe=gpt_tiny", "++model.config.vocab_size=8003", "trainer.max_steps=4", "optim.warmup_steps=1"]
    run_cli(tmp_path / "gpu_like", *common, "model.vocab_pad_multiple=64", "trainer.save_every=2")
    step2 = tmp_path / "gpu_like" / "checkpoints" / "step_2"
    proc = run_cli(tmp_path / "cpu", *common, f"trainer.resume={step2}")
    assert "re-sharded from" in proc.stdout
    assert losses(tmp_path / "cpu") == pytest.approx(losses(tmp_path / "gpu_like")[2:], rel=1e-5, abs=0)
