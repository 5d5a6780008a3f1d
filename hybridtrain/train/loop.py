"""The training loop: one optimizer step per global batch, metrics and progress on rank 0."""
from __future__ import annotations

import json
import math
import time
from pathlib import Path
from typing import Any, Callable

from hybridtrain.config.schema import Config
from hybridtrain.data.sampler import Samples
from hybridtrain.parallel.dims import BatchLayout
from hybridtrain.engine import Built
from hybridtrain.observe.clock import StepClock
from hybridtrain.plan.types import Plan
from hybridtrain.rundir import RunDir
from hybridtrain.train.datawait import DataTimer
from hybridtrain.train.evaluate import Evaluator
from hybridtrain.train.prefetch import DeviceBatches
from hybridtrain.train.preempt import StopRequest
from hybridtrain.train.preference import step_metrics
from hybridtrain.train.watchdog import Watchdog


class MetricsWriter:
    """Appends one JSON object per logged step to ``metrics.jsonl`` (global rank 0 only)."""

    def __init__(self, path: Path | None, append: bool = False, also: Callable[[dict], None] | None = None):
        self._file = open(path, "a" if append else "w", buffering=1) if path is not None else None
        self._also = also  # the logger (TensorBoard, W&B) gets every record too
        if append and path is not None and not _ends_a_line(path):
            self._file.write("\n")  # a line cut by a killed run or a full disk stays alone: readers skip it

    def write(self, record: dict[str, Any]) -> None:
        """Append ``record``; a non-finite number (an fp16 overflow's infinite gradient norm) is written
        as ``null`` and its key listed under ``nonfinite``: JSON has no ``Infinity`` or ``NaN``."""
        bad = [k for k, v in record.items() if isinstance(v, float) and not math.isfinite(v)]
        if bad:
            record = {**{k: (None if k in bad else v) for k, v in record.items()}, "nonfinite": bad}
        if self._file is not None:
            self._file.write(json.dumps(record, allow_nan=False) + "\n")
            if self._also is not None:
                self._also(record)

    def mark_resume(self, step: int, checkpoint: Path) -> None:
        """Append the record of a resume (:data:`hybridtrain.rundir.RESUME_EVENT`): readers drop what an
        earlier run logged after ``step`` (:meth:`hybridtrain.rundir.RunDir.metrics`). The file only: a
        logger gets training records."""
        from hybridtrain.rundir import RESUME_EVENT

        if self._file is not None:
            self._file.write(json.dumps({"event": RESUME_EVENT, "step": step, "checkpoint": str(checkpoint)}) + "\n")

    def close(self) -> None:
        if self._file is not None:
            self._file.close()


def _ends_a_line(path: Path) -> bool:
    """Whether file ``path`` is empty or ends in a newline (then an appended record starts a line of its own)."""
    with open(path, "rb") as f:
        if f.seek(0, 2) == 0:
            return True
        f.seek(-1, 2)
        return f.read(1) == b"\n"


def _step_pipeline(built: Built, stream) -> float:
    return float(built.engine.train_batch(data_iter=stream))


def _step_sequential(built: Built, samples: Samples, step: int, layout: BatchLayout, timer: DataTimer,
                     clock: StepClock) -> float:
    import torch

    from hybridtrain.parallel import collectives

    engine = built.engine
    total = torch.zeros((), dtype=torch.float32, device=engine.device)
    batches = DeviceBatches(samples.micro_batches(step, layout, built.dp_rank, weighted=True), engine.device)
    for inputs, target in timer.wrap(batches):  # target: (labels, weight), or a preference pair's tuple
        with clock.span("forward"):  # spans feed stage times and the timeline (hybridtrain/observe)
            inputs = tuple(t.to(engine.device) for t in inputs)  # (input_ids, position_ids)
            loss = engine(inputs, tuple(t.to(engine.device) for t in target))
        with clock.span("backward"):
            engine.backward(loss)
        with clock.span("optimizer"):  # a real step only at the accumulation boundary
            engine.step()
        total += loss.detach().float()
    total /= layout.grad_accum
    if layout.averaged_over > 1:  # report the global-batch loss, as the pipeline engine does
        total = collectives.all_reduce(total, engine.device, group=built.groups.data_group) / layout.averaged_over
    return float(total)


def train(cfg: Config, plan: Plan, built: Built, samples: Samples, run_dir: Path, is_rank0: bool,
          start_step: int = 0, save: Callable[[int], None] | None = None,
          stop: StopRequest | None = None, resumed_from: Path | None = None) -> list[float]:
    """Run optimizer steps ``start_step`` .. ``trainer.max_steps - 1``; return their losses.

    ``save(step)`` is called (on every rank) after every ``trainer.save_every`` steps and after the
    last one when ``trainer.save_final``. With ``stop``, the ranks agree after every step whether a
    stop signal arrived; if so they save (if this step did not already) and leave the loop early,
    recording the step in ``stop.stopped_at`` (:mod:`hybridtrain.train.preempt`). A run resumed from
    checkpoint ``resumed_from`` (at ``start_step``) first marks the resume in ``metrics.jsonl``.
    """
    layout = plan.batch_layout()
    engine = built.engine
    timer = DataTimer()  # data: wait time and validation (hybridtrain/train/evaluate.py)
    evaluator = Evaluator.from_run_dir(run_dir, cfg, plan, built)
    stream = (timer.wrap(DeviceBatches(samples.stream(start_step, layout, built.dp_rank, weighted=True), engine.device))
              if plan.dims.pp > 1 else None)
    from hybridtrain.observe.observer import Observer

    obs = Observer.create(cfg, plan, built, run_dir, is_rank0, start_step)  # MFU, memory, stage times, timeline
    from hybridtrain.train.expert_load import ExpertLoad

    load = ExpertLoad.of(built, plan.dims.ep, is_rank0)  # ep > 1: the dispatch's peak load per rank
    writer = MetricsWriter(RunDir(run_dir).metrics_file if is_rank0 else None, append=start_step > 0, also=obs.log)
    if resumed_from is not None:
        writer.mark_resume(start_step, resumed_from)
    bar = None
    if is_rank0:
        from tqdm import tqdm

        bar = tqdm(total=cfg.trainer.max_steps, initial=start_step, desc="train", unit="step", dynamic_ncols=True)
    losses: list[float] = []
    start = time.perf_counter()
    watchdog = Watchdog(cfg.trainer.hang_timeout_s).start()  # no step for hang_timeout_s: stacks, exit
    for step in range(start_step, cfg.trainer.max_steps):
        log_now = (step + 1) % cfg.trainer.log_every == 0 or step + 1 == cfg.trainer.max_steps
        obs.begin_step(step + 1, log_now)
        lr = engine.get_lr()[0]  # this step's: an fp16 step skipped on overflow does not advance the schedule
        t0, wait0 = time.perf_counter(), timer.seconds
        loss = (_step_pipeline(built, stream) if plan.dims.pp > 1
                else _step_sequential(built, samples, step, layout, timer, obs.clock))
        dt = time.perf_counter() - t0
        if step == start_step:
            built.stop_watching()  # the model state's peaks are measured; they do not change
        observed = obs.end_step(dt, timer.seconds - wait0, log_now)  # every rank: gathers on log steps
        observed = {**observed, **step_metrics(built, log_now)}  # finetune.objective=dpo: TRL's rewards/, logps/
        if load is not None:
            observed.update(load.step(step + 1, engine.device, log_now))
        losses.append(loss)
        tokens_per_sec = plan.tokens_per_step / dt
        loss_tokens = samples.step_loss_tokens(step, plan.global_batch_size)  # padding and prompts excluded
        if bar is not None:
            bar.set_postfix(loss=f"{loss:.4f}", loss_tok_s=f"{loss_tokens / dt:,.0f}", **obs.postfix(dt))
            bar.update(1)
        if log_now:
            norm = engine.get_global_grad_norm()
            writer.write({
                "step": step + 1, "loss": loss, "lr": lr,
                "grad_norm": float(norm) if norm is not None else None,
                **({"skipped_steps": int(engine.skipped_steps)} if plan.precision != "fp32" else {}),
                "tokens_per_sec": tokens_per_sec, "loss_tokens": loss_tokens, "loss_tokens_per_sec": loss_tokens / dt,
                "step_time_s": dt,
                "elapsed_s": time.perf_counter() - start,
                "model_state_bytes": built.model_state_bytes, "data_wait_s": timer.seconds - wait0,
                **observed,
            })
        done = step + 1
        if evaluator is not None and evaluator.due(done):
            writer.write(evaluator.run(built, done))
        every = cfg.trainer.save_every
        final = done == cfg.trainer.max_steps and cfg.trainer.save_final
        due = save is not None and bool((every and done % every == 0) or final)
        if due:
            save(done)
        watchdog.beat()
        if stop is not None and done < cfg.trainer.max_steps and stop.agreed(engine.device):
            stop.stopped_at = done
            if save is not None and not due:
                save(done)
            break
    watchdog.stop()
    if bar is not None:
        bar.close()
    writer.close()
    obs.finish()  # report.md (rank 0), logger closed
    return losses
