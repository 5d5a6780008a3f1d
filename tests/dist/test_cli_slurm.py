"""The SLURM launcher through the real CLI: bad inputs caught before anything is submitted, and the
job script written (and printed) without submitting."""
from __future__ import annotations

import os
import sys

import pytest


from hybridtrain.rundir import RunDir
from helpers.launch import run_cli


def test_cli_refuses_nodes_x_gpus_mismatch_before_submitting(tmp_path):
    proc = run_cli(tmp_path, "+recipe=gpt_tiny", "launcher=slurm", "launcher.nodes=2", "launcher.gpus_per_node=3",
                   "parallel.dp=2", "parallel.pp=2", check=False, timeout=120)
    assert proc.returncode == 2, proc.stderr[-2000:]
    assert "config error: launcher.gpus_per_node:" in proc.stderr and "4 ranks" in proc.stderr
    assert not RunDir(tmp_path).job_script.exists() and "Traceback" not in proc.stderr


def test_cli_without_sbatch_says_slurm_client_tools_are_needed(tmp_path):
    # PATH holds only this Python's folder: no sbatch (the machine may well have SLURM installed)
    bindir = tmp_path / "bin"
    bindir.mkdir()
    os.symlink(sys.executable, bindir / "python")
    proc = run_cli(tmp_path / "run", "+recipe=gpt_tiny", "launcher=slurm", "launcher.nodes=2", "parallel.pp=2",
                   check=False, timeout=180, env={"PATH": str(bindir)})
    assert proc.returncode == 1, proc.stdout[-2000:] + proc.stderr[-2000:]
    assert "sbatch not found" in proc.stderr and "SLURM's client tools" in proc.stderr
    assert RunDir(tmp_path / "run").job_script.is_file()  # written, so it can be submitted elsewhere


def test_cli_submit_false_writes_and_prints_the_script(tmp_path):
    proc = run_cli(tmp_path, "+recipe=gpt_tiny", "launcher=slurm", "launcher.nodes=2", "parallel.pp=2",
                   "launcher.submit=false", "launcher.gpus=false", "launcher.time=00:10:00", timeout=180)
    files = RunDir(tmp_path)
    script = files.job_script.read_text()
    assert script in proc.stdout and "#SBATCH --time=00:10:00" in script and "not submitted" in proc.stdout
    assert files.config_file.is_file() and not files.data_file.exists()
    # the job's first step prepares the data the controller skipped, once
    from hybridtrain.errors import PlanError
    from hybridtrain.launch.slurm_job import prepare_data

    cfg = files.config()
    good, cfg.data.cache_dir = cfg.data.cache_dir, "/proc/qa-cache"  # the job's node probes its cache folder
    files.write_config(cfg)
    with pytest.raises(PlanError, match="data.cache_dir: cannot write the cache folder /proc/qa-cache"):
        prepare_data(tmp_path)
    cfg.data.cache_dir = good
    files.write_config(cfg)
    assert prepare_data(tmp_path) and files.data_file.is_file()
    assert not prepare_data(tmp_path)


def test_cli_llama_7b_slurm_script_anywhere(tmp_path):
    proc = run_cli(tmp_path, "+recipe=llama_7b", "launcher=slurm", "launcher.nodes=4", "launcher.submit=false",
                   "launcher.partition=gpu", "launcher.gpus=true", timeout=180)
    script = RunDir(tmp_path).job_script.read_text()
    for line in ["#SBATCH --nodes=4", "#SBATCH --ntasks-per-node=8", "#SBATCH --gpus-per-node=8", "#SBATCH --partition=gpu"]:
        assert line in script.splitlines()
    assert "groups crossing nodes: dp, pp" in proc.stdout  # tp=2 stays inside a node; dp=8 and pp cross
