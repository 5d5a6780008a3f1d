"""Launch behaviour: a bad plan starts nothing, sweeps, the console script, the local launcher's limits,
how the local launcher starts CPU ranks and what rank 0 says when it is ready, one run per run directory.

A dead or hung rank: ``tests/dist/test_faults.py``."""
from __future__ import annotations

import json
import os
import subprocess
import time

from hybridtrain import cli
from hybridtrain.cli import Background
from hybridtrain.rundir import RunDir
from helpers.launch import NO_REPORT, REPO, metrics, run_cli


def test_bad_plan_launches_nothing(tmp_path):
    proc = run_cli(tmp_path, "+recipe=gpt_tiny", "parallel.tp=4", check=False, timeout=120)
    assert proc.returncode == 2
    assert "parallel.tp=4 must divide model.config.n_head=6" in proc.stderr
    assert "deepspeed.launcher.runner" not in proc.stdout
    assert not RunDir(tmp_path).plan_file.exists()


def test_hydra_multirun_sweep_writes_one_run_per_value(tmp_path):
    proc = cli.run(None, ["-m", "+recipe=gpt_tiny", "parallel.tp=1,2", "launcher.dry_run=true",
                          f"hydra.sweep.dir={tmp_path}"], cwd=REPO, timeout=180)
    assert proc.returncode == 0, proc.stderr[-3000:]
    tps = sorted(RunDir(p).config().parallel.tp for p in tmp_path.iterdir() if RunDir(p).config_file.is_file())
    assert tps == [1, 2]


def test_console_script_is_installed(tmp_path):
    import shutil

    exe = shutil.which("hybridtrain")
    assert exe, "the `hybridtrain` console script is not on PATH (pip install -e . installs it)"
    proc = subprocess.run([exe, "+recipe=gpt_tiny", "launcher.dry_run=true", f"hydra.run.dir={tmp_path}"],
                          capture_output=True, text=True, timeout=120)
    assert proc.returncode == 0, proc.stderr[-3000:]
    assert RunDir(tmp_path).config_file.exists() and RunDir(tmp_path).plan_file.exists()


def test_multi_node_plan_is_refused_by_the_local_launcher_before_anything_runs(tmp_path):
    proc = run_cli(tmp_path, "+recipe=gpt_tiny", "launcher.nodes=2", check=False, timeout=120)
    assert proc.returncode == 2
    assert "launcher.nodes=2" in proc.stderr and "dry_run" in proc.stderr
    assert not RunDir(tmp_path).config_file.exists()


def test_cpu_ranks_fork_from_one_import_unless_preload_is_off(tmp_path):
    """The local launcher forks CPU ranks from one process that imported their libraries once, and with
    ``HYBRIDTRAIN_PRELOAD=0`` starts each as its own interpreter (what GPU ranks do); either way rank 0
    reports ready with the host memory freed by its tensors kept for reuse (``launcher.keep_host_memory``,
    on by default). (``test_parity.py`` checks that both ways give the same losses.) One rank, one step each,
    both jobs started at once."""
    overrides = ["+recipe=gpt_tiny", "trainer.max_steps=1", "optim.warmup_steps=1", "trainer.save_final=false",
                 "trainer.report=false"]
    jobs = {own: Background(tmp_path / f"own{own}" / "run", overrides, tmp_path / f"own{own}", cwd=REPO,
                            env={**os.environ, "HYBRIDTRAIN_PRELOAD": "0"} if own else None)
            for own in (False, True)}
    for own, job in jobs.items():
        proc = job.result(timeout=300)
        assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
        assert ("forked after one import" in proc.stdout) != own, proc.stdout[-3000:]
        assert "[hybridtrain] rank 0 ready in " in proc.stdout, proc.stdout[-3000:]
        assert "freed host memory kept for reuse" in proc.stdout, proc.stdout[-3000:]


def test_a_second_run_in_a_busy_run_directory_is_refused_and_the_folder_resumes_after(tmp_path):
    """Run A trains; run B, given the same ``hydra.run.dir``, exits 2 naming A's controller and writes
    nothing (A's config.yaml, plan.json and Hydra's files stay A's); A ends as if alone; a resume into
    the folder once A is gone takes the lock A left behind."""
    run_dir, files = tmp_path / "run", RunDir(tmp_path / "run")
    common = ["+recipe=gpt_tiny", "optim.warmup_steps=1", NO_REPORT]
    with open(tmp_path / "a.txt", "w") as out:
        first = cli.start(run_dir, [*common, "trainer.max_steps=3"], cwd=REPO, stdout=out, stderr=subprocess.STDOUT)
    try:
        deadline = time.monotonic() + 240
        while not files.plan_file.is_file() and first.poll() is None and time.monotonic() < deadline:
            time.sleep(0.2)
        assert files.plan_file.is_file(), (tmp_path / "a.txt").read_text()[-3000:]
        theirs = {f: f.read_bytes() for f in (files.config_file, files.plan_file, run_dir / ".hydra" / "overrides.yaml")}
        second = run_cli(run_dir, *common, "parallel.pp=2", "trainer.max_steps=3", check=False, timeout=120)
        assert second.returncode == 2, second.stdout[-3000:] + second.stderr[-3000:]
        assert first.poll() is None, "run A ended before run B tried: the refusal was not tested"
        assert (f"[hybridtrain] config error: hydra.run.dir: {run_dir} is in use by another run (pid {first.pid} on "
                "host ") in second.stderr and "Traceback" not in second.stderr
        assert "[hybridtrain]" not in second.stdout  # refused before the plan
        assert json.loads(files.lock_file.read_text())["pid"] == first.pid  # B did not even touch the record
        assert first.wait(timeout=300) == 0, (tmp_path / "a.txt").read_text()[-3000:]
    finally:
        first.kill()
    assert {f: f.read_bytes() for f in theirs} == theirs, "run B wrote into run A's folder"
    assert [m["step"] for m in metrics(run_dir)] == [1, 2, 3]
    resumed = run_cli(run_dir, *common, "trainer.max_steps=4", "trainer.resume=auto", timeout=300)
    assert "resumed from" in resumed.stdout and [m["step"] for m in metrics(run_dir)][-1] == 4
