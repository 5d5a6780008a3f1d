"""``scripts/install.sh`` decides which torch to install; ``--dry-run`` prints the pip commands, so each
choice is checked here without downloading anything."""
from __future__ import annotations

import os
import subprocess

import pytest

from helpers.launch import REPO


def _install(tmp_path, *args: str, has_torch: bool = True, gpu: bool = False) -> subprocess.CompletedProcess:
    python = tmp_path / "python"  # stands in for the interpreter: answers the script's torch probes
    python.write_text(f"#!/bin/sh\nexit {0 if has_torch else 1}\n")
    python.chmod(0o755)
    smi = tmp_path / "nvidia-smi"
    smi.write_text("#!/bin/sh\nexit 0\n")
    smi.chmod(0o755)
    env = dict(os.environ, PYTHON=str(python), HYBRIDTRAIN_NVIDIA_SMI=str(smi) if gpu else "no-such-nvidia-smi")
    env.pop("HYBRIDTRAIN_TORCH", None)
    env.pop("TORCH_INDEX_URL", None)
    return subprocess.run(["bash", str(REPO / "scripts" / "install.sh"), "--dry-run", *args], cwd=REPO, env=env,
                          capture_output=True, text=True, timeout=60)


def _pip(proc) -> list[str]:
    assert proc.returncode == 0, proc.stdout + proc.stderr
    return [ln[2:] for ln in proc.stdout.splitlines() if ln.startswith("+ ")]


def test_cuda_build_for_a_cluster_from_a_gpu_less_login_node(tmp_path):
    cmds = _pip(_install(tmp_path, "--cuda", "12.4", has_torch=True))  # a CPU build there: replaced
    assert any(c.endswith("pip uninstall -y -q torch") for c in cmds)
    assert any("pip install -q torch --index-url https://download.pytorch.org/whl/cu124" in c for c in cmds)
    assert cmds[-1].endswith("pip install -q -e .")


def test_cpu_default_without_gpu_and_torch_stays_the_cpu_build(tmp_path):
    cmds = _pip(_install(tmp_path, has_torch=False))
    assert len(cmds) == 2 and "pip install -q torch==2.13.0" in cmds[0] and "cu1" not in cmds[0]


@pytest.mark.parametrize("has_torch,gpu", [(True, False), (False, True)])
def test_torch_left_to_pip_when_present_or_on_a_gpu_machine(tmp_path, has_torch, gpu):
    cmds = _pip(_install(tmp_path, has_torch=has_torch, gpu=gpu))
    assert len(cmds) == 1 and cmds[0].endswith("pip install -q -e .")


def test_offline_install_from_carried_wheels(tmp_path):
    cmds = _pip(_install(tmp_path, "--cuda", "12.8", "--wheels", "/wheels", "--dev", has_torch=False))
    assert any("--no-index --find-links /wheels torch" in c for c in cmds)
    assert "--no-index --find-links /wheels --no-build-isolation -e .[dev]" in cmds[-1]


@pytest.mark.parametrize("args,fragment", [(["--cuda", "twelve"], "such as 12.4"), (["--cuda", "12.4", "--cpu"], "exclude"),
                                           (["--nope"], "unknown option")])
def test_bad_options_exit_2(tmp_path, args, fragment):
    proc = _install(tmp_path, *args)
    assert proc.returncode == 2 and fragment in proc.stderr
