"""The local launcher without processes: its command is what the deepspeed runner would start for
one node, and what of the ranks' stdout reaches the console (``launcher.verbose``)."""
from __future__ import annotations

import io
import sys
from pathlib import Path

import pytest

from hybridtrain.launch.output import for_console, pump
from hybridtrain.plan.types import Plan


def _plan(world: int) -> Plan:
    names = ["embed", "block.0", "final_norm", "head"]
    return Plan(dp=world, tp=1, pp=1, world_size=world, nodes=1, micro_batch_size=1, grad_accum=1,
                global_batch_size=world, zero_stage=1, precision="fp32", seq_len=8, tokens_per_step=8 * world,
                vocab_size=10, padded_vocab_size=10, num_layers=1, layer_names=names, stage_bounds=[0, 4])


def _launch_args(cmd: list[str], monkeypatch) -> dict:
    """``cmd`` (``python -u -m deepspeed.launcher.launch ...``) as DeepSpeed's launcher parses it."""
    from deepspeed.launcher import launch

    assert cmd[1:4] == ["-u", "-m", "deepspeed.launcher.launch"], cmd
    monkeypatch.setattr(sys, "argv", ["launch.py", *cmd[4:]])
    return vars(launch.parse_args())


@pytest.mark.parametrize("world", [1, 3])
def test_local_command_is_the_runners_single_node_launch(world, monkeypatch, tmp_path):
    """The runner (``--num_gpus N``) on one node only builds this command and starts it; started
    directly, DeepSpeed's launcher receives the same arguments."""
    from deepspeed.accelerator import get_accelerator
    from deepspeed.launcher import runner

    from hybridtrain.launch.local import command

    started = []

    class Capture:
        def __init__(self, cmd, env=None):
            started.append(cmd)
            self.returncode = 0

        def wait(self):
            return 0

    monkeypatch.setattr(runner.subprocess, "Popen", Capture)  # nothing is started
    monkeypatch.setattr(type(get_accelerator()), "device_count", lambda self: 8)
    monkeypatch.delenv("CUDA_VISIBLE_DEVICES", raising=False)
    runner.main(["--num_gpus", str(world), "--master_port", "29511", "--no_local_rank", "--module",
                 "hybridtrain.worker", str(tmp_path)])
    ours = command(tmp_path, _plan(world), 29511)
    assert ours[0] == started[0][0] == sys.executable
    assert _launch_args(ours, monkeypatch) == _launch_args(started[0], monkeypatch)


LINES = [
    (b"[2026-12-01 02:05:35,144] [WARNING] [real_accelerator.py:213:get_accelerator] Setting accelerator to CPU.\n",
     False),
    (b"[2026-12-01 02:05:36,223] [INFO] [launch.py:152:main] WORLD INFO DICT: {'localhost': [0, 1]}\n", False),
    (b"node1: [2026-12-01 02:05:36,223] [INFO] [launch.py:245:main] process 13379 spawned with command: [...]\n",
     False),
    (b"SEED_LAYERS=False BASE_SEED=1234 SEED_FN=None\n", False),
    (b"Using topology: {ProcessCoord(pipe=0, data=0, model=0): 0}\n", False),
    (b"[hybridtrain] rank 0 ready in 3.4s (stage 0, tp_rank 0, dp_rank 0)\n", True),
    (b"[2026-12-01 02:05:41,229] [ERROR] [launch.py:325:sigkill_handler] ['python', '-u'] exits with return code = 1\n",
     True),
    (b"rank    2  node node1        dp 0  tp 0  pp 1\n", True),
    (b"host1:123:456 [0] NCCL WARN Net : Connection closed by remote peer\n", True),
    (b"some line a library printed\n", True),
]


@pytest.mark.parametrize("line,shown", LINES)
def test_deepspeed_info_and_warnings_leave_the_console_errors_stay(line, shown):
    assert for_console(line) is shown


def test_pump_logs_every_line_and_shows_the_kept_ones():
    stream = io.BytesIO(b"".join(line for line, _ in LINES))
    console, log = io.BytesIO(), io.BytesIO()
    pump(stream, console, log)
    assert log.getvalue() == stream.getvalue()
    assert console.getvalue() == b"".join(line for line, shown in LINES if shown)


def test_verbose_is_a_launcher_key_off_by_default():
    from hybridtrain.config.schema import LauncherConfig

    assert LauncherConfig().verbose is False
    for name in ("local", "slurm", "multinode"):
        text = (Path(__file__).resolve().parents[2] / "conf" / "launcher" / f"{name}.yaml").read_text()
        assert "verbose: false" in text, name
