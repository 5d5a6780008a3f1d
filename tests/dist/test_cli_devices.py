"""The command line on a machine without CUDA: a job that asked for GPUs stops before launching."""
from __future__ import annotations

from launch_helpers import run_cli


def test_gpus_asked_on_a_machine_without_cuda_exits_2_before_launching(tmp_path):
    proc = run_cli(tmp_path, "+recipe=gpt_tiny", "launcher.gpus=true", check=False, timeout=300)
    assert proc.returncode == 2, proc.stdout[-3000:] + proc.stderr[-3000:]
    assert "config error: launcher.gpus: launcher.gpus=true but torch" in proc.stderr
    assert "Traceback" not in proc.stderr and "launching" not in proc.stdout
    assert not (tmp_path / "config.yaml").exists()  # nothing prepared, nothing started
