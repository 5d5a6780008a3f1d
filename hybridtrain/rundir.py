"""The run directory: the name of every file a run writes, and their typed readers.

Every module that touches a run's files goes through :class:`RunDir`, so each name is spelled
here only (the folders inside a checkpoint: :class:`hybridtrain.checkpoint.io.CheckpointDir`)::

    RUN_DIR/
      config.yaml          the resolved config (controller; the SLURM job may point trainer.resume on)
      plan.json            the resolved plan
      data.json            where the prepared samples lie (memory-mapped by the workers)
      metrics.jsonl        one record per logged step and per validation (rank 0)
      observe.json         the device peak and model FLOPs per token the MFU uses (rank 0)
      timeline.png         timeline_trace.json, timeline_events.json, timeline_summary.json:
                           the profiled steps (trainer.profile_steps)
      report.md, report/   the end-of-run report and its plots
      checkpoints/         step_N folders and the latest pointer
      hf/                  the HF model of the last step (trainer.export_hf)
      stopped.json         left by rank 0 after a stop on a signal, taken by the launcher
      job.sbatch           slurm-JOBID.out: launcher=slurm
      hostfile             .deepspeed_env: launcher=multinode
      tensorboard/         logger=tensorboard (default folder)
      .hybridtrain.lock    the run's lock: who holds the folder (:mod:`hybridtrain.launch.lock`)

The controller (``python -m hybridtrain``) takes the lock before it writes anything, then writes the
first three before any worker starts, each atomically (with ``launcher.no_ssh`` every node's controller
writes the same shared files).
"""
from __future__ import annotations

import json
import os
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Callable

from hybridtrain.config import Config, load_config, save_config
from hybridtrain.plan.types import Plan

CONFIG = "config.yaml"
"""The resolved config; a checkpoint holds a copy under the same name."""
PLAN = "plan.json"
"""The resolved plan; a checkpoint holds a copy under the same name."""
RESUME_EVENT = "resume"
"""``metrics.jsonl``'s ``{"event": "resume", "step": N, "checkpoint": PATH}``: a run resumed at step N."""
LOCK = ".hybridtrain.lock"
"""The run's lock file (:attr:`RunDir.lock_file`)."""


@dataclass(frozen=True)
class RunDir:
    """The files of the run in ``path`` (nothing is read or created until asked for)."""

    path: Path

    def __post_init__(self) -> None:
        object.__setattr__(self, "path", Path(self.path))

    # -- names ------------------------------------------------------------------------------------

    @property
    def config_file(self) -> Path:
        """``config.yaml``: the resolved config every worker reads."""
        return self.path / CONFIG

    @property
    def plan_file(self) -> Path:
        """``plan.json``: the resolved :class:`~hybridtrain.plan.types.Plan`."""
        return self.path / PLAN

    @property
    def data_file(self) -> Path:
        """``data.json``: the prepared samples' record (:class:`hybridtrain.data.prepare.Prepared`)."""
        return self.path / "data.json"

    @property
    def metrics_file(self) -> Path:
        """``metrics.jsonl``: one JSON record per logged step and per validation."""
        return self.path / "metrics.jsonl"

    @property
    def observe_file(self) -> Path:
        """``observe.json``: the MFU peak and its source, model FLOPs per token, the device."""
        return self.path / "observe.json"

    @property
    def timeline_png(self) -> Path:
        """``timeline.png``: the profiled steps drawn per rank."""
        return self.path / "timeline.png"

    @property
    def timeline_trace(self) -> Path:
        """``timeline_trace.json``: the profiled spans as a Chrome trace."""
        return self.path / "timeline_trace.json"

    @property
    def timeline_events(self) -> Path:
        """``timeline_events.json``: the raw profiled spans."""
        return self.path / "timeline_events.json"

    @property
    def timeline_summary(self) -> Path:
        """``timeline_summary.json``: measured and theoretical bubble of the profiled steps."""
        return self.path / "timeline_summary.json"

    @property
    def report_file(self) -> Path:
        """``report.md``: the end-of-run report."""
        return self.path / "report.md"

    @property
    def report_dir(self) -> Path:
        """``report/``: the report's plots."""
        return self.path / "report"

    @property
    def checkpoints(self) -> Path:
        """``checkpoints/``: the ``step_N`` folders (:mod:`hybridtrain.checkpoint.io`)."""
        return self.path / "checkpoints"

    @property
    def hf_dir(self) -> Path:
        """``hf/``: the HF model folder exported after the last step (``trainer.export_hf``)."""
        return self.path / "hf"

    @property
    def stop_marker(self) -> Path:
        """``stopped.json``: rank 0's note that the ranks stopped on a signal with a checkpoint."""
        return self.path / "stopped.json"

    @property
    def job_script(self) -> Path:
        """``job.sbatch``: the SLURM job script (``launcher=slurm``)."""
        return self.path / "job.sbatch"

    def slurm_log(self, job_id: str) -> Path:
        """``slurm-JOBID.out``: the output of SLURM job ``job_id`` (``job_id="%j"``: the pattern sbatch fills)."""
        return self.path / f"slurm-{job_id}.out"

    @property
    def hostfile(self) -> Path:
        """``hostfile``: the deepspeed runner's hosts when ``launcher.hostfile`` is not given."""
        return self.path / "hostfile"

    @property
    def deepspeed_env(self) -> Path:
        """``.deepspeed_env``: variables the multinode runner passes to every host."""
        return self.path / ".deepspeed_env"

    @property
    def tensorboard_dir(self) -> Path:
        """``tensorboard/``: TensorBoard's event files unless ``logger.dir`` is set."""
        return self.path / "tensorboard"

    @property
    def lock_file(self) -> Path:
        """``.hybridtrain.lock``: the ``flock`` the controller holds while its run owns the folder, and the
        holder's pid, host, start time and command (:mod:`hybridtrain.launch.lock`)."""
        return self.path / LOCK

    def node_lock_file(self, node: int) -> Path:
        """The lock of node ``node``'s controller: :attr:`lock_file` for node 0, ``.hybridtrain.lock.nodeK``
        for node ``K`` of a ``launcher.no_ssh`` job (every node runs the controller on the shared folder)."""
        return self.lock_file if node == 0 else self.path / f"{LOCK}.node{node}"

    # -- readers ----------------------------------------------------------------------------------

    def config(self) -> Config:
        """The typed config of ``config.yaml`` (checked against the schema)."""
        return load_config(self.config_file)

    def plan(self) -> Plan:
        """The :class:`Plan` of ``plan.json``."""
        return Plan.from_dict(json.loads(self.plan_file.read_text()))

    def plan_record(self) -> dict[str, Any] | None:
        """``plan.json`` as written, or ``None`` when there is none (the report reads what it finds)."""
        return _json_or_none(self.plan_file)

    def metric_records(self, skipped: list[int] | None = None) -> list[dict[str, Any]]:
        """Every line of ``metrics.jsonl`` as written: training steps, validations and resume events. A line that
        is not a JSON object (cut short by a killed run or a full disk) is left out, its 1-based number appended
        to ``skipped``: one bad line must not hide the rest of the history."""
        if not self.metrics_file.is_file():
            raise FileNotFoundError(f"{self.metrics_file} does not exist: give the run directory of a training run")
        out = []
        for number, line in enumerate(self.metrics_file.read_text(errors="replace").splitlines(), 1):
            if not line.strip():
                continue
            try:
                record = json.loads(line)
            except ValueError:
                record = None
            if isinstance(record, dict):
                out.append(record)
            elif skipped is not None:
                skipped.append(number)
        return out

    def metrics(self, skipped: list[int] | None = None) -> list[dict[str, Any]]:
        """The run's one history in step order: training steps and validations, as it continues from
        each resume. A resume at step N (its event record) replaces what an earlier run logged after
        step N (steps a killed run trained past its checkpoint, or the newer steps of a resume that
        fell back to an older checkpoint); the event records themselves are left out (:meth:`resumes`). Unreadable
        lines are skipped (their numbers appended to ``skipped``, :meth:`metric_records`)."""
        out: list[dict[str, Any]] = []
        for record in self.metric_records(skipped):
            if record.get("event") == RESUME_EVENT:
                out = [r for r in out if r.get("step", 0) <= record["step"]]
            elif "event" not in record:
                out.append(record)
        return out

    def resumes(self) -> list[dict[str, Any]]:
        """The resume events of ``metrics.jsonl`` (``step``, ``checkpoint``), in order."""
        return [r for r in self.metric_records() if r.get("event") == RESUME_EVENT]

    def losses(self) -> list[float]:
        """The training loss of every logged step (validation records left out)."""
        return [r["loss"] for r in self.metrics() if "loss" in r]

    def observe(self) -> dict[str, Any] | None:
        """``observe.json``, or ``None`` when the run did not get that far."""
        return _json_or_none(self.observe_file)

    def timeline(self) -> dict[str, Any] | None:
        """``timeline_summary.json``, or ``None`` when no step was profiled."""
        return _json_or_none(self.timeline_summary)

    def timeline_spans(self) -> list[dict[str, Any]]:
        """The raw spans of ``timeline_events.json``."""
        return json.loads(self.timeline_events.read_text())

    # -- the controller's writers -----------------------------------------------------------------

    def write_config(self, cfg: Config) -> None:
        """Write ``config.yaml`` atomically."""
        _atomic(self.config_file, lambda tmp: save_config(cfg, tmp))

    def write_plan(self, plan: Plan) -> None:
        """Write ``plan.json`` atomically."""
        _atomic(self.plan_file, lambda tmp: tmp.write_text(json.dumps(plan.to_dict(), indent=1)))

    def write_data(self, prepared) -> None:
        """Write ``data.json`` atomically from a :class:`hybridtrain.data.prepare.Prepared`."""
        _atomic(self.data_file, lambda tmp: tmp.write_text(prepared.to_json()))


def _json_or_none(path: Path) -> Any:
    return json.loads(path.read_text()) if path.is_file() else None


def _atomic(path: Path, write: Callable[[Path], None]) -> None:
    """``write(tmp)`` then rename over ``path``, so a reader never sees a half-written file."""
    tmp = path.with_name(f".{path.name}.{os.getpid()}")
    write(tmp)
    os.replace(tmp, path)
