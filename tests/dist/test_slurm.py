"""Many machines for real: jobs on a SLURM cluster brought up on this machine (scripts/slurm_up.sh:
Debian's slurmctld, two slurmd nodes, munge), the deepspeed runner's ``--no_ssh`` launch of two
nodes, and the stop-on-signal checkpoint of the local launcher. Every run is ``gpt_tiny`` at
dp=2 x pp=2 over 2 nodes x 2 ranks, compared step by step with the same plan run locally."""
from __future__ import annotations

import json
import os
import re
import shutil
import signal
import subprocess
import threading
import time
from pathlib import Path

import pytest

from hybridtrain import cli
from hybridtrain.rundir import RunDir
from helpers.launch import REPO, losses, metrics, run_cli


STEPS = 16
PLAN = ["+recipe=gpt_tiny", "parallel.dp=2", "parallel.pp=2", f"trainer.max_steps={STEPS}",
        "launcher.threads_per_rank=1", "trainer.save_final=false"]
TWO_NODES = ["launcher.nodes=2", "launcher.gpus_per_node=2"]
SLURM = ["launcher=slurm", *TWO_NODES, "launcher.wait=true", "launcher.gpus=false", "launcher.time=00:10:00"]


def close(got: list[float], want: list[float], rel: float = 1e-5) -> None:
    assert len(got) == len(want), (got, want)
    for step, (a, b) in enumerate(zip(got, want), 1):
        assert abs(a - b) <= rel * abs(b), f"step {step}: {a} vs {b}"


@pytest.fixture(scope="module")
def reference(tmp_path_factory) -> list[float]:
    """The losses of the plan run by the local launcher on one machine."""
    run_dir = tmp_path_factory.mktemp("local") / "run"
    run_cli(run_dir, *PLAN, timeout=400)
    return losses(run_dir)


def _daemons_running() -> bool:
    pid = Path("/var/lib/slurm-ci/run/slurmctld.pid")
    try:
        return Path(f"/proc/{int(pid.read_text())}/comm").read_text().strip() == "slurmctld"
    except (OSError, ValueError):
        return False


@pytest.fixture(scope="module")
def slurm_cluster():
    """A real two-node SLURM cluster on this machine for the tests of this module, stopped afterwards
    unless it was already running before them."""
    if os.geteuid() != 0:
        pytest.skip("bringing up SLURM (scripts/slurm_up.sh) needs root: it installs packages and starts daemons")
    installed = shutil.which("slurmctld") or Path("/usr/sbin/slurmctld").exists()
    if not installed and shutil.which("apt-get") is None:
        pytest.skip("SLURM is not installed and apt-get is missing: scripts/slurm_up.sh installs Debian's packages")
    was_up = _daemons_running()
    up = subprocess.run(["bash", str(REPO / "scripts" / "slurm_up.sh")], capture_output=True, text=True, timeout=900)
    if up.returncode != 0:
        pytest.fail(f"scripts/slurm_up.sh failed (exit {up.returncode}):\n{up.stdout[-3000:]}\n{up.stderr[-3000:]}")
    yield
    if not was_up:
        subprocess.run(["bash", str(REPO / "scripts" / "slurm_down.sh")], capture_output=True, timeout=120)


class Background:
    """``python -m hybridtrain ...`` in the background, its output collected line by line."""

    def __init__(self, run_dir: Path, *overrides: str, env: dict | None = None):
        self.proc = cli.start(run_dir, overrides, env=env, cwd=REPO, stdout=subprocess.PIPE,
                              stderr=subprocess.STDOUT, text=True)
        self.lines: list[str] = []
        self._reader = threading.Thread(target=self._read, daemon=True)
        self._reader.start()

    def _read(self) -> None:
        for line in self.proc.stdout:
            self.lines.append(line)

    @property
    def output(self) -> str:
        return "".join(self.lines)

    def wait_for(self, what, timeout: float) -> None:
        """Poll ``what()`` until true; fail (and stop the process) on timeout or an early exit."""
        end = time.monotonic() + timeout
        while not what():
            if self.proc.poll() is not None or time.monotonic() > end:
                self.proc.kill()
                raise AssertionError(f"gave up waiting (exit {self.proc.poll()}):\n{self.output[-5000:]}")
            time.sleep(0.1)

    def finish(self, timeout: float) -> int:
        try:
            code = self.proc.wait(timeout=timeout)
        except subprocess.TimeoutExpired:
            self.proc.kill()
            raise AssertionError(f"still running after {timeout}s:\n{self.output[-5000:]}")
        self._reader.join(10)
        return code


def _logged_steps(run_dir: Path) -> int:
    path = RunDir(run_dir).metrics_file
    return len(path.read_text().splitlines()) if path.is_file() else 0


def _slurm_log(run_dir: Path) -> str:
    return "\n".join(p.read_text(errors="replace") for p in sorted(run_dir.glob(RunDir(run_dir).slurm_log("*").name)))


SITECUSTOMIZE = """
import json, os
if os.environ.get("HT_TEST_ENV_DIR") and os.environ.get("SLURM_STEP_ID") == "0":  # an srun task: what it was given
    keys = ("SLURM_PROCID", "CUDA_VISIBLE_DEVICES", "DS_ACCELERATOR", "SLURM_CPUS_PER_TASK")
    with open(os.path.join(os.environ["HT_TEST_ENV_DIR"], f"task{os.getpid()}.json"), "w") as f:
        json.dump({k: os.environ.get(k) for k in keys}, f)
if os.environ.get("SLURM_PROCID") == "1" and os.environ.get("HT_TEST_FAIL_RANK"):
    os._exit(3)  # rank 1 dies while starting: its srun task exits 3
"""


def test_slurm_job_whose_rank_fails_reports_status_and_log(slurm_cluster, tmp_path):
    inject = tmp_path / "inject"
    inject.mkdir()
    (inject / "sitecustomize.py").write_text(SITECUSTOMIZE)
    run_dir = tmp_path / "run"
    seen = tmp_path / "seen"
    seen.mkdir()
    proc = run_cli(run_dir, *PLAN, *SLURM, check=False, timeout=300,
                   env={"PYTHONPATH": f"{inject}:{REPO}", "HT_TEST_FAIL_RANK": "1", "HT_TEST_ENV_DIR": str(seen),
                        "CUDA_VISIBLE_DEVICES": "0"})
    assert proc.returncode != 0, proc.stdout[-3000:]
    job = re.search(r"submitted job (\d+)", proc.stdout).group(1)
    log = RunDir(run_dir).slurm_log(job)
    assert f"job {job} failed with exit code {proc.returncode}" in proc.stderr, proc.stderr[-3000:]
    assert f"log {log}" in proc.stderr and log.is_file()
    assert "task 1: Exited with exit code 3" in log.read_text()
    # launcher.gpus=false: the ranks see no GPU whatever the submitting shell showed, and DeepSpeed's CPU accelerator
    tasks = [json.loads(f.read_text()) for f in seen.glob("task*.json")]
    # srun ends the step when task 1 exits: a task it stops before its interpreter starts writes nothing
    assert "1" in {t["SLURM_PROCID"] for t in tasks} and len(tasks) >= 2, tasks
    assert {(t["CUDA_VISIBLE_DEVICES"], t["DS_ACCELERATOR"], t["SLURM_CPUS_PER_TASK"]) for t in tasks} == {("", "cpu", "1")}


def test_hostnames_uses_scontrol(slurm_cluster):
    """A job's node list is expanded by SLURM's own ``scontrol show hostnames`` (here in the tier that
    brings SLURM up, so that it runs on a fresh machine too, not only where SLURM was installed before)."""
    from hybridtrain.launch import env

    assert env.hostnames("node[1-3],gpu07") == ["node1", "node2", "node3", "gpu07"]


def test_rejected_submission_shows_slurms_message(slurm_cluster, tmp_path):
    proc = run_cli(tmp_path, *PLAN, *SLURM, "launcher.partition=nosuchpartition", check=False, timeout=200)
    assert proc.returncode == 1, proc.stdout[-2000:]
    assert "SLURM rejected the job" in proc.stderr and "invalid partition" in proc.stderr.lower(), proc.stderr
    assert "launcher.partition" in proc.stderr


def test_a_submitted_jobs_folder_is_refused_to_another_run_until_the_job_ends(slurm_cluster, tmp_path):
    """The controller exits after ``sbatch``; the folder's lock file names the job, and a second command
    into the folder exits 2 while ``squeue`` lists the job; once it is cancelled the folder is free."""
    run_dir = tmp_path / "run"
    submitted = run_cli(run_dir, *PLAN, *[o for o in SLURM if not o.startswith("launcher.wait=")], "launcher.wait=false",
                        timeout=300)
    job = re.search(r"submitted job (\d+)", submitted.stdout).group(1)
    try:
        second = run_cli(run_dir, *PLAN, check=False, timeout=120)
        assert second.returncode == 2, second.stdout[-3000:] + second.stderr[-3000:]
        assert f"hydra.run.dir: {run_dir} is in use by SLURM job {job} (" in second.stderr, second.stderr
        assert f"scancel {job} ends it" in second.stderr
    finally:
        subprocess.run(["scancel", job], timeout=30)
    deadline = time.monotonic() + 120
    while True:  # CANCELLED, then no longer listed: the folder is free
        again = run_cli(run_dir, *PLAN, "launcher.dry_run=true", check=False, timeout=120)
        if again.returncode == 0 or time.monotonic() > deadline:
            break
        time.sleep(2)
    assert again.returncode == 0, again.stderr[-3000:]


@pytest.mark.slow  # CI keeps real sbatch/srun jobs (a failing rank, a rejected submission) and the local SIGTERM checkpoint
def test_signal_checkpoint_requeue_resume_matches_an_uninterrupted_run(slurm_cluster, reference, tmp_path):
    """A two-node SLURM job, stopped by SLURM's signal, requeued and resumed: together it trains exactly
    like the plan run locally, and rank 0 prints where each rank runs."""
    run = Background(tmp_path, *PLAN, *SLURM)
    run.wait_for(lambda: re.search(r"submitted job (\d+)", run.output), timeout=200)
    job = re.search(r"submitted job (\d+)", run.output).group(1)
    run.wait_for(lambda: _logged_steps(tmp_path) >= 2, timeout=300)
    # what SLURM sends signal_seconds before the time limit (--signal=USR1@N), sent now
    subprocess.run(["scancel", "--signal=USR1", job], check=True, timeout=30)
    assert run.finish(timeout=400) == 0, run.output[-5000:]
    log = _slurm_log(tmp_path)
    stopped = int(re.search(r"stopped by SIGUSR1 after step (\d+)", log).group(1))
    assert 2 <= stopped < STEPS
    assert f"requeueing job {job}" in log and f"restart 1: resuming from {tmp_path}/checkpoints/step_{stopped}" in log
    assert f"resumed from {tmp_path}/checkpoints/step_{stopped} at step {stopped} (same plan)" in log
    assert (RunDir(tmp_path).checkpoints / f"step_{stopped}" / "meta.json").is_file()
    assert [m["step"] for m in metrics(tmp_path)] == list(range(1, STEPS + 1))
    close(losses(tmp_path), reference)
    assert re.search(r"submitted job \d+; log .*slurm-\d+\.out", run.output) and f"job {job} completed" in run.output
    # rank 0 prints the rank map: consecutive ranks per node, only the pipeline crosses nodes
    for line in ["rank    0  node node1        dp 0  tp 0  pp 0", "rank    1  node node1        dp 1  tp 0  pp 0",
                 "rank    2  node node2        dp 0  tp 0  pp 1", "rank    3  node node2        dp 1  tp 0  pp 1",
                 "groups crossing nodes: pp"]:
        assert line in log, log[-3000:]
    assert RunDir(tmp_path).job_script.is_file() and RunDir(tmp_path).config_file.is_file()


@pytest.mark.slow  # the multinode launcher's rules and runner command stay in CI (test_multinode.py)
def test_two_node_no_ssh_launch_matches_the_local_run(reference, tmp_path):
    from hybridtrain.ports import free_port

    port = free_port()
    common = [*PLAN, "launcher=multinode", *TWO_NODES, "launcher.no_ssh=true", "launcher.master_addr=127.0.0.1",
              f"launcher.master_port={port}"]
    nodes = [Background(tmp_path, *common, f"launcher.node_rank={k}") for k in (0, 1)]
    codes = [n.finish(timeout=400) for n in nodes]
    assert codes == [0, 0], "\n".join(n.output[-3000:] for n in nodes)
    assert "--no_ssh --node_rank 1" in nodes[1].output
    assert "rank    2  node node1" in nodes[0].output  # the generated hostfile names node0, node1
    close(losses(tmp_path), reference)


def test_local_sigterm_saves_a_checkpoint_and_exits_cleanly(reference, tmp_path):
    run = Background(tmp_path, *PLAN)
    run.wait_for(lambda: _logged_steps(tmp_path) >= 2, timeout=300)
    run.proc.send_signal(signal.SIGTERM)
    assert run.finish(timeout=200) == 0, run.output[-5000:]
    stopped = int(re.search(r"stopped early after step (\d+)", run.output).group(1))
    assert 2 <= stopped < STEPS and "Traceback" not in run.output
    assert (RunDir(tmp_path).checkpoints / f"step_{stopped}" / "meta.json").is_file()
    assert not RunDir(tmp_path).stop_marker.exists()
    # every process of the job names the run directory on its command line: the preload process and the
    # ranks forked from it keep the controller's, a rank started as its own interpreter has
    # `hybridtrain.worker RUN_DIR`
    left = subprocess.run(["pgrep", "-af", str(tmp_path)], capture_output=True, text=True)
    assert left.stdout.strip() == "", f"processes left behind:\n{left.stdout}"
    assert [m["step"] for m in metrics(tmp_path)] == list(range(1, stopped + 1))
    close(losses(tmp_path), reference[:stopped])
    # resuming from it is what the requeue test above checks, through the same worker code
