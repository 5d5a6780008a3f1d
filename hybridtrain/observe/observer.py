"""What the training loop reports beyond the loss: throughput, MFU, memory, stage times, timeline.

The loop calls, on every rank and at the same steps: :meth:`Observer.begin_step` and
:meth:`Observer.end_step` around each optimizer step and :meth:`Observer.finish` after the last.
On log steps ``end_step`` gathers one small vector per rank (:mod:`.gather`) and returns the
extra ``metrics.jsonl`` fields on rank 0; after the last profiled step it gathers the recorded
spans and rank 0 writes the timeline; ``finish`` writes ``report.md`` and closes the logger.
"""
from __future__ import annotations

import json
import time
from pathlib import Path
from typing import Any

from hybridtrain.observe import gather, loggers, resources
from hybridtrain.observe.clock import CATEGORIES, KINDS, StepClock
from hybridtrain.observe.peak import Peak, resolve_peak
from hybridtrain.parallel import collectives
from hybridtrain.rundir import RunDir


def _opt(v: float) -> float | None:
    return None if v < 0 else v


class Observer:
    """One rank's observability state for a run; see the module docstring for the call order."""

    def __init__(self, cfg, plan, built, run_dir: Path, is_rank0: bool, start_step: int,
                 peak: Peak | None, flops_per_token: float):
        import torch

        self.cfg, self.plan, self.built, self.run_dir, self.is_rank0 = cfg, plan, built, Path(run_dir), is_rank0
        self.device = built.engine.device
        on_gpu = getattr(self.device, "type", str(self.device)) == "cuda"
        # GPU spans are CUDA events, read once per measured step (StepClock.stop): no per-span stall
        self.clock = StepClock(events=(lambda: torch.cuda.Event(enable_timing=True)) if on_gpu else None)
        self.peak, self.flops_per_token = peak, flops_per_token
        self.profile = sorted({s for s in cfg.trainer.profile_steps if start_step < s <= cfg.trainer.max_steps})
        self._rows: list[list[float]] = []  # recorded spans: step, kind index, micro-batch, start, end
        self._origins: dict[int, float] = {}
        self._step = 0
        self.nvml = resources.NvmlSampler.create(self.device)
        self.logger = None
        if is_rank0:
            from omegaconf import OmegaConf

            self.logger = loggers.create(cfg.logger, self.run_dir, OmegaConf.to_container(OmegaConf.structured(cfg)))
        if plan.dims.pp > 1:
            from hybridtrain.observe.pipe_timer import instrument

            instrument(built.engine, self.clock)

    @classmethod
    def create(cls, cfg, plan, built, run_dir: Path, is_rank0: bool, start_step: int = 0) -> "Observer":
        """Set up on every rank; rank 0 finds the device peak (on a CPU possibly a 1 s matmul probe,
        run while the other ranks wait at a barrier so they do not load the cores)."""
        import torch

        peak, flops = None, 0.0
        if is_rank0:
            from hybridtrain.cache import CacheDir
            from hybridtrain.models.families import family_of
            from hybridtrain.plan import model_config
            from hybridtrain.plan.costs import has_score_head
            from hybridtrain.plan.flops import model_flops_per_token

            # a reward model's head is its score, one output per token (hybridtrain/models/score.py)
            flops = model_flops_per_token(family_of(cfg.model), model_config(cfg), plan.seq_len,
                                          1 if has_score_head(cfg) else plan.vocab_size)
            device = built.engine.device
            name = torch.cuda.get_device_name(device) if getattr(device, "type", "") == "cuda" else None
            peak = resolve_peak(cfg.trainer.peak_tflops, plan.precision, name,
                                CacheDir.from_env().peak_file, torch.get_num_threads(),
                                tf32=cfg.trainer.tf32)
            print("[hybridtrain] MFU peak: "
                  + (f"{peak.tflops:.3g} TFLOP/s per device ({peak.source})" if peak.tflops else peak.source)
                  + f"; {flops / 1e6:.2f} MFLOP per token (model FLOPs, forward + backward)", flush=True)
            RunDir(run_dir).observe_file.write_text(json.dumps({
                "peak_tflops": peak.tflops, "peak_source": peak.source, "device": name or "cpu",
                "model_flops_per_token": flops, "world_size": plan.world_size, "precision": plan.precision,
                "gpu_total_bytes": torch.cuda.get_device_properties(device).total_memory if name else None,
                "gpu_uuid": str(torch.cuda.get_device_properties(device).uuid) if name else None,  # which GPU
                "profile_steps": list(cfg.trainer.profile_steps)}, indent=1))
        collectives.barrier(built.engine.device)
        return cls(cfg, plan, built, run_dir, is_rank0, start_step, peak, flops)

    # -- per step ---------------------------------------------------------------------------------

    def begin_step(self, step: int, log: bool) -> None:
        """Before optimizer step ``step`` (1-based): measure it if ``log`` or profiled."""
        self._step = step
        profiled = step in self.profile
        if profiled:
            collectives.barrier(self.device)  # a common time origin for every rank's spans
        if log or profiled:
            self.clock.start(record=profiled)
            if profiled:
                self._origins[step] = self.clock.origin

    def throughput(self, step_time_s: float) -> tuple[float, float | None]:
        """``(model TFLOP/s per device, MFU or None)`` of a step of ``step_time_s`` (rank 0)."""
        tflops = self.flops_per_token * self.plan.tokens_per_step / step_time_s / self.plan.world_size / 1e12
        return tflops, self.peak.mfu(tflops) if self.peak is not None else None

    def postfix(self, step_time_s: float) -> dict[str, str]:
        """Progress-bar fields (rank 0): MFU when the peak is known."""
        if not self.is_rank0:
            return {}
        _, mfu = self.throughput(step_time_s)
        return {"mfu": f"{mfu:.1%}"} if mfu is not None else {}

    def end_step(self, step_time_s: float, data_wait_s: float, log: bool) -> dict[str, Any]:
        """After the step: the extra ``metrics.jsonl`` fields on a log step (rank 0; ``{}`` elsewhere).
        Every rank must call this with the same ``log``: it runs collectives."""
        step = self._step
        self.clock.stop()
        if step in self.profile:
            kind_id = {k: i for i, k in enumerate(KINDS)}
            self._rows += [[step, kind_id.get(k, -1), mb, t0, t1] for k, mb, t0, t1 in self.clock.events]
            if step == self.profile[-1]:
                self._write_timeline()
        if not log:
            return {}
        return self._gather_metrics(step_time_s, data_wait_s)

    def _gather_metrics(self, step_time_s: float, data_wait_s: float) -> dict[str, Any]:
        built = self.built
        gpu_peak = resources.gpu_peak_bytes(self.device)
        util = self.nvml.take() if self.nvml is not None else None
        mine = [built.stage, *(self.clock.totals[c] for c in CATEGORIES), data_wait_s, step_time_s,
                resources.rss_bytes(), -1 if gpu_peak is None else gpu_peak, -1 if util is None else util,
                built.model_state_bytes["total"]]
        ranks = gather.all_ranks(mine, self.device)
        if not self.is_rank0:
            return {}
        col = {name: [r[i] for r in ranks] for i, name in enumerate(gather.RANK_FIELDS)}
        stages = range(self.plan.dims.pp)

        def per_stage(name: str) -> list[float]:
            vals = [[v for v, s in zip(col[name], col["stage"]) if int(s) == st] for st in stages]
            return [sum(v) / len(v) if v else 0.0 for v in vals]

        tflops, mfu = self.throughput(step_time_s)
        out: dict[str, Any] = {
            "tflops_per_device": tflops, "mfu": mfu,
            "stage_forward_s": per_stage("forward_s"), "stage_backward_s": per_stage("backward_s"),
            "stage_comm_s": per_stage("comm_s"), "stage_optimizer_s": per_stage("optimizer_s"),
            "stage_step_time_s": per_stage("step_time_s"),
            "data_wait_max_s": max(col["data_wait_s"]),
            "rank_rss_bytes": [int(v) for v in col["rss_bytes"]], "rss_max_bytes": int(max(col["rss_bytes"])),
            "rank_model_state_bytes": [int(v) for v in col["model_state_bytes"]],
        }
        if gpu_peak is not None:
            out["rank_gpu_peak_bytes"] = [int(v) if v >= 0 else None for v in col["gpu_peak_bytes"]]
        if any(v >= 0 for v in col["gpu_util"]):
            out["rank_gpu_util"] = [_opt(v) for v in col["gpu_util"]]
        return out

    def _write_timeline(self) -> None:
        per_rank = gather.all_rows(self._rows, gather.EVENT_WIDTH, self.device)
        self._rows = []
        if not self.is_rank0:
            return
        from hybridtrain.observe import timeline

        plan = self.plan
        events = []
        dims = plan.dims
        for rank, rows in enumerate(per_rank):
            c = dims.coords(rank)
            for step, k, mb, t0, t1 in rows:
                events.append({"rank": rank, "stage": c.pp, "dp_rank": c.dp, "tp_rank": c.tp,
                               "step": int(step), "kind": KINDS[int(k)] if k >= 0 else "other",
                               "micro_batch": int(mb), "start": t0, "end": t1})
        first = min(self._origins.values())
        offsets = {s: o - first for s, o in self._origins.items()}
        t0 = time.perf_counter()
        try:
            summary = timeline.write(self.run_dir, events, offsets, plan.dims.pp, plan.grad_accum)
        except Exception as err:  # noqa: BLE001 - a failed picture must not end the training run
            import traceback

            traceback.print_exc()
            print(f"[hybridtrain] timeline not written ({err}); training continues", flush=True)
            return
        files = RunDir(self.run_dir)
        print(f"[hybridtrain] timeline of step(s) {summary['steps']}: bubble measured "
              f"{summary['bubble_measured']:.1%}, theory (pp-1)/(m+pp-1) = {summary['bubble_theory']:.1%}; "
              f"{files.timeline_png}, {files.timeline_trace} "
              f"({time.perf_counter() - t0:.1f}s)", flush=True)

    # -- records and the end ----------------------------------------------------------------------

    def log(self, record: dict[str, Any]) -> None:
        """Send a ``metrics.jsonl`` record to the logger (rank 0; a no-op without one)."""
        if self.logger is not None:
            self.logger.log(record)

    def finish(self) -> None:
        """After the last step: ``report.md`` (rank 0, ``trainer.report``), close logger and NVML."""
        if self.nvml is not None:
            self.nvml.close()
        if self.logger is not None:
            self.logger.close()
        if self.is_rank0 and self.cfg.trainer.report:
            from hybridtrain.report import write_report

            try:
                path = write_report(self.run_dir)
                print(f"[hybridtrain] report: {path}", flush=True)
            except Exception as err:  # noqa: BLE001 - the run's results stand without the report
                import traceback

                traceback.print_exc()
                print(f"[hybridtrain] report failed ({err}); rerun `python -m hybridtrain.report "
                      f"{self.run_dir}`", flush=True)
