"""``python -m hybridtrain.plan`` as a command: a 70B plan in seconds, exit code 2 on a config error."""
from __future__ import annotations

import subprocess
import sys
import time


from helpers.config import LLAMA_70B, ROOT


def test_plan_command_70b_in_seconds():
    """A 70B Llama on 8 x 8 GPUs, from the command line: no weights, no processes, seconds."""
    t0 = time.perf_counter()
    proc = subprocess.run([sys.executable, "-m", "hybridtrain.plan", *LLAMA_70B, "parallel.tp=8", "parallel.pp=4", "parallel.dp=null",
                           "launcher.nodes=8", "launcher.gpus_per_node=8", "plan.device_memory_gb=80"],
                          cwd=ROOT, capture_output=True, text=True, timeout=180)
    elapsed = time.perf_counter() - t0
    assert proc.returncode == 0, proc.stdout + proc.stderr
    out = proc.stdout
    assert "68,976.6M parameters, 80 blocks" in out
    assert "dp=2 x tp=8 x pp=4 = 64 rank(s) on 8 node(s)" in out
    assert "     63     7    1    7    3" in out  # last rank: node 7, dp 1, tp 7, pp 3
    assert "memory per rank in GiB of a 70.00 GiB budget" in out and "bubble" in out  # 90% of 80 GiB - 2 GiB
    assert elapsed < 60, f"plan command took {elapsed:.1f}s"  # ~3 s on a quiet 2-core machine


def test_plan_command_config_error_exits_2():
    proc = subprocess.run([sys.executable, "-m", "hybridtrain.plan", "+recipe=gpt_tiny", "parallel.tp=4"],
                          cwd=ROOT, capture_output=True, text=True, timeout=120)
    assert proc.returncode == 2 and "config error: parallel.tp" in proc.stderr
