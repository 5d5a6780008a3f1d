"""The run directory (``hybridtrain.rundir.RunDir``) and a checkpoint folder (``CheckpointDir``): the
file names users and docs rely on, and every reader against what the writers of the run write."""
from __future__ import annotations

import errno
import json
import os
import socket
from dataclasses import dataclass, replace

import pytest

from helpers.config import compose
from hybridtrain.checkpoint.io import (DIGESTS, CheckpointDir, file_digests, file_sizes, finalize, latest_checkpoint,
                                      step_dir, tmp_dir)
from hybridtrain.observe import timeline
from hybridtrain.plan import Machine, resolve
from hybridtrain.launch import lock as run_lock
from hybridtrain.launch.lock import DirInUse, RunLock, record_job
from hybridtrain.launch.outdir import check_given, lock_node
from hybridtrain.rundir import CONFIG, PLAN, RunDir
from hybridtrain.train.preempt import take_marker, write_marker

NAMES = {
    "config_file": "config.yaml", "plan_file": "plan.json", "data_file": "data.json",
    "metrics_file": "metrics.jsonl", "observe_file": "observe.json", "timeline_png": "timeline.png",
    "timeline_trace": "timeline_trace.json", "timeline_events": "timeline_events.json",
    "timeline_summary": "timeline_summary.json", "report_file": "report.md", "report_dir": "report",
    "checkpoints": "checkpoints", "hf_dir": "hf", "stop_marker": "stopped.json", "job_script": "job.sbatch",
    "hostfile": "hostfile", "deepspeed_env": ".deepspeed_env", "tensorboard_dir": "tensorboard",
    "lock_file": ".hybridtrain.lock",
}
"""The names docs/training.md, docs/observability.md, docs/checkpoints.md and docs/slurm.md document."""


def test_every_file_of_a_run_has_its_documented_name(tmp_path):
    files = RunDir(str(tmp_path))  # a str is fine: it becomes a Path
    for attr, name in NAMES.items():
        assert getattr(files, attr) == tmp_path / name, attr
    assert files.slurm_log("123") == tmp_path / "slurm-123.out"
    assert files.node_lock_file(0) == files.lock_file and files.node_lock_file(2) == tmp_path / ".hybridtrain.lock.node2"
    assert (CONFIG, PLAN) == ("config.yaml", "plan.json")
    assert not any(tmp_path.iterdir()), "naming a file must not create it"


@dataclass
class _Prepared:
    """Stands in for :class:`hybridtrain.data.prepare.Prepared` (the writer calls ``to_json``)."""

    text: str

    def to_json(self) -> str:
        return self.text


def test_the_controllers_files_read_back_as_written(tmp_path):
    cfg = compose("+recipe=gpt_tiny", "parallel.pp=2")
    cfg.run_dir = str(tmp_path)
    plan, _ = resolve(cfg, Machine())
    files = RunDir(tmp_path)
    files.write_config(cfg)
    files.write_plan(plan)
    files.write_data(_Prepared('{"kind": "packed"}'))
    assert files.config() == cfg
    assert files.plan() == plan and files.plan_record() == plan.to_dict()
    assert json.loads(files.plan_file.read_text()) == plan.to_dict()
    assert json.loads(files.data_file.read_text()) == {"kind": "packed"}
    assert sorted(p.name for p in tmp_path.iterdir()) == ["config.yaml", "data.json", "plan.json"]  # no temp left
    cfg.trainer.max_steps = 7  # written again (the SLURM job's first step does): replaced whole
    files.write_config(cfg)
    assert files.config().trainer.max_steps == 7


def test_a_plan_json_written_before_the_partition_method_was_recorded_reads(tmp_path):
    plan, _ = resolve(compose("+recipe=gpt_tiny", "parallel.pp=2"), Machine())
    older = {k: v for k, v in plan.to_dict().items() if k != "partition_method"}
    RunDir(tmp_path).plan_file.write_text(json.dumps(older))
    assert RunDir(tmp_path).plan() == replace(plan, partition_method="")


def test_metrics_and_losses(tmp_path):
    files = RunDir(tmp_path)
    with pytest.raises(FileNotFoundError, match="metrics.jsonl does not exist: give the run directory"):
        files.metrics()
    records = [{"step": 1, "loss": 5.0}, {"step": 2, "loss": 4.5}, {"step": 2, "val_loss": 4.8, "val_ppl": 121.5},
               {"step": 3, "loss": 4.0}]
    files.metrics_file.write_text("\n".join(json.dumps(r) for r in records) + "\n\n")
    assert files.metrics() == records
    assert files.losses() == [5.0, 4.5, 4.0]  # the validation record is not a step's loss


def test_metrics_continue_from_a_resume(tmp_path):
    """A run that logged steps 1-4, was resumed from step_2 (its step_4 unloadable), then logged 3 and
    4 again and validated: one history, the resumed run's records replacing those after step 2."""
    files = RunDir(tmp_path)
    first = [{"step": s, "loss": 10.0 - s} for s in (1, 2, 3, 4)] + [{"step": 4, "val_loss": 7.0}]
    resume = {"event": "resume", "step": 2, "checkpoint": str(tmp_path / "checkpoints" / "step_2")}
    second = [{"step": 3, "loss": 6.5}, {"step": 4, "loss": 6.0}, {"step": 4, "val_loss": 6.9}]
    files.metrics_file.write_text("\n".join(json.dumps(r) for r in first + [resume] + second) + "\n")
    assert files.metrics() == first[:2] + second
    assert [r["step"] for r in files.metrics() if "loss" in r] == [1, 2, 3, 4]
    assert files.losses() == [9.0, 8.0, 6.5, 6.0]
    assert files.resumes() == [resume] and len(files.metric_records()) == 9


def test_optional_files_read_as_none_until_written(tmp_path):
    files = RunDir(tmp_path)
    assert files.observe() is None and files.timeline() is None and files.plan_record() is None
    files.observe_file.write_text(json.dumps({"peak_tflops": 1.5, "peak_source": "trainer.peak_tflops"}))
    assert files.observe()["peak_tflops"] == 1.5
    events = [{"rank": r, "stage": r, "dp_rank": 0, "tp_rank": 0, "step": 1, "kind": k, "micro_batch": 0,
               "start": 0.5 * r + (0.0 if k == "forward" else 1.0), "end": 0.5 * r + (0.5 if k == "forward" else 1.5)}
              for r in (0, 1) for k in ("forward", "backward")]
    summary = timeline.write(tmp_path, events, {1: 0.0}, pp=2, micro_batches=1)
    assert files.timeline() == json.loads(json.dumps(summary)) and files.timeline_spans() == events
    assert summary["files"] == {"png": files.timeline_png.name, "trace": files.timeline_trace.name}
    assert files.timeline_png.is_file() and files.timeline_trace.is_file()


def test_stop_marker_is_taken_once(tmp_path):
    files = RunDir(tmp_path)
    write_marker(tmp_path, 4, step_dir(tmp_path, 4))
    assert files.stop_marker.is_file()
    assert take_marker(tmp_path) == {"step": 4, "checkpoint": str(tmp_path / "checkpoints" / "step_4")}
    assert not files.stop_marker.exists() and take_marker(tmp_path) is None


def test_checkpoint_folder_names_and_the_newest_complete_one(tmp_path):
    final = step_dir(tmp_path, 3)
    assert final == RunDir(tmp_path).checkpoints / "step_3" and tmp_dir(final).name == ".tmp-step_3"
    ckpt = CheckpointDir(tmp_dir(final))
    assert [p.name for p in (ckpt.ds, ckpt.hf, ckpt.optim, ckpt.rng, ckpt.meta_file, ckpt.config_file,
                             ckpt.plan_file)] == ["ds", "hf", "optim", "rng", "meta.json", "config.yaml", "plan.json"]
    assert ckpt.hf_part(1) == ckpt.hf / "model-stage001.safetensors"
    assert ckpt.optim_part(0) == ckpt.optim / "optim-stage000.safetensors"
    assert ckpt.rng_file(12) == ckpt.rng / "rank_00012.safetensors"
    for d in (ckpt.ds, ckpt.hf):
        d.mkdir(parents=True)
    for stage in (1, 0):
        ckpt.hf_part(stage).write_bytes(b"")
    (ckpt.hf / "config.json").write_text("{}")
    assert ckpt.hf_parts() == [ckpt.hf_part(0), ckpt.hf_part(1)]  # stage order, nothing else
    ckpt.meta_file.write_text(json.dumps({"step": 3, "samples_seen": 36, "plan": {}, "files": file_sizes(ckpt.path), DIGESTS: file_digests(ckpt.path)}))
    assert latest_checkpoint(tmp_path) is None  # not published yet
    finalize(ckpt.path, final, keep_last=None)
    assert latest_checkpoint(tmp_path) == final and CheckpointDir(final).meta()["step"] == 3
    assert (final.parent / "latest").read_text() == "step_3"


def test_a_run_directory_has_one_owner_until_it_lets_go(tmp_path):
    """Two open files of one lock conflict as two processes would (an flock belongs to the open file)."""
    files = RunDir(tmp_path)
    first = RunLock.acquire(files.lock_file)
    record = json.loads(files.lock_file.read_text())
    assert (record["pid"], record["host"]) == (os.getpid(), socket.gethostname())
    assert record["started"].endswith(" UTC") and record["command"].startswith("python -m hybridtrain")
    with pytest.raises(DirInUse, match=rf"^in use by another run \(pid {os.getpid()} on host {socket.gethostname()} since "):
        RunLock.acquire(files.lock_file)
    first.release()
    RunLock.acquire(files.lock_file).release()  # let go: the next run (a resume into the folder) takes it
    assert files.lock_file.is_file()  # the file stays: never replaced under a holder


def test_a_lock_file_left_behind_by_a_dead_run_does_not_block(tmp_path):
    files = RunDir(tmp_path)
    files.lock_file.write_text(json.dumps({"pid": 4_000_000, "host": "gone", "started": "long ago"}))
    lock = RunLock.acquire(files.lock_file)  # no process holds its flock: stale, taken over
    assert json.loads(files.lock_file.read_text())["pid"] == os.getpid()
    lock.release()


def test_a_folder_stays_its_slurm_jobs_while_squeue_lists_the_job(tmp_path):
    path = RunDir(tmp_path).lock_file
    controller = RunLock.acquire(path)
    record_job(path, "42")  # after sbatch; then the controller exits
    controller.release()
    assert json.loads(path.read_text())["slurm_job"] == "42"
    with pytest.raises(DirInUse, match=r"^in use by SLURM job 42 \(PENDING\)$") as err:
        RunLock.acquire(path, job_state=lambda job: "PENDING" if job == "42" else None)
    assert err.value.wait == "for job 42 to end (scancel 42 ends it)"
    for state in ("COMPLETED", None):  # ended, or no longer listed (or no squeue)
        RunLock.acquire(path, job_state=lambda job: state).release()


def test_a_file_system_without_flock_warns_and_runs_unguarded(tmp_path, monkeypatch):
    def no_locks(fd, op):
        raise OSError(errno.ENOLCK, "No locks available")

    monkeypatch.setattr(run_lock.fcntl, "flock", no_locks)
    lock = RunLock.acquire(RunDir(tmp_path).lock_file)
    assert lock.fd is None and "has no flock, so a second run in this folder is not refused" in lock.warning
    lock.release()


def test_which_lock_a_controller_takes():
    from omegaconf import OmegaConf

    def cfg(**launcher):
        return OmegaConf.create({"launcher": launcher})

    assert lock_node(cfg(name="local")) == 0
    assert lock_node(cfg(name="multinode", no_ssh=False, node_rank=0)) == 0  # one controller reaches every host
    assert lock_node(cfg(name="multinode", no_ssh=True, node_rank=3)) == 3  # every node runs one: its own slot


def test_an_empty_run_directory_is_refused():
    for empty in ("", "  ", None):
        message = check_given(empty, "hydra.run.dir")
        assert message.startswith("hydra.run.dir: an empty value would write the run into the current folder ")
        assert "e.g. hydra.run.dir=runs/my_run" in message
    assert check_given("runs/a", "hydra.run.dir") is None and check_given(".", "hydra.run.dir") is None
