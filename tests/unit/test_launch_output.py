"""The local launcher without processes: its ranks get what DeepSpeed's launcher would give them on
one node, and what of their stdout reaches the console (``launcher.verbose``)."""
from __future__ import annotations

import io
import sys

import pytest

from hybridtrain.launch.output import for_console, pump


@pytest.mark.parametrize("world", [1, 3])
def test_ranks_get_the_command_and_environment_deepspeeds_launcher_gives_them(world, monkeypatch, tmp_path):
    """What the deepspeed runner (``--num_gpus N``) has DeepSpeed's per-node launcher start on one
    node, captured without starting anything, is what the local launcher starts itself."""
    import base64
    import json
    import os

    from deepspeed.launcher import launch as ds_launch

    from hybridtrain.launch.local import command
    from hybridtrain.launch.ranks import rank_env

    started = []

    class Exited:  # a rank that has already exited cleanly
        returncode = 0

        def __init__(self, cmd, env=None):
            started.append((list(cmd), dict(env)))  # the launcher reuses one dict for every rank
            self.pid = 1

        def poll(self):
            return 0

    monkeypatch.setattr(ds_launch.subprocess, "Popen", Exited)
    monkeypatch.setattr(ds_launch.signal, "signal", lambda *args: None)  # leave pytest's handlers alone
    monkeypatch.setattr(ds_launch.time, "sleep", lambda s: None)
    world_info = base64.urlsafe_b64encode(json.dumps({"localhost": list(range(world))}).encode()).decode()
    monkeypatch.setattr(sys, "argv", ["launch.py", f"--world_info={world_info}", "--master_addr=127.0.0.1",
                                      "--master_port=29511", "--module", "--no_local_rank",
                                      "hybridtrain.worker", str(tmp_path)])
    ds_launch.main()
    assert len(started) == world
    for rank, (cmd, env) in enumerate(started):
        assert cmd == command(tmp_path)
        assert env == rank_env(dict(os.environ), rank, world, 29511, range(world))


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
    from helpers.config import compose

    for name in ("local", "slurm", "multinode"):
        assert compose("+recipe=gpt_tiny", f"launcher={name}").launcher.verbose is False, name
