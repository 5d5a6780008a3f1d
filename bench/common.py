"""Shared pieces of the benchmark suite: the machine line, alternating runs, launching
``python -m hybridtrain`` with phase timestamps, and reading what a run wrote."""
from __future__ import annotations

import os
import platform
import statistics
import subprocess
import threading
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Callable

from hybridtrain import cli
from hybridtrain.cli import REPO as ROOT
from hybridtrain.rundir import RunDir

INJECT = Path(__file__).resolve().parent / "inject"

PHASES = [  # (name, first stdout line starting with this marks the end of the phase)
    ("config + plan", "[hybridtrain] model "),
    ("data (cached)", "[hybridtrain] data "),
    ("controller to runner", "[hybridtrain] launching"),
    ("runner + workers ready", "[hybridtrain] rank 0 ready in"),
]


def machine() -> dict:
    """Where the benchmark ran: CPU model, cores, GPU, versions, load average."""
    import deepspeed
    import torch
    import transformers

    cpu = platform.processor() or platform.machine()
    try:
        for line in Path("/proc/cpuinfo").read_text().splitlines():
            if line.startswith("model name"):
                cpu = line.split(":", 1)[1].strip()
                break
    except OSError:
        pass
    gpu = torch.cuda.get_device_name(0) if torch.cuda.is_available() else "no GPU"
    return {"cpu": cpu, "cores": os.cpu_count(), "gpu": gpu, "python": platform.python_version(),
            "torch": torch.__version__, "deepspeed": deepspeed.__version__,
            "transformers": transformers.__version__, "os": f"{platform.system()} {platform.release()}",
            "loadavg_start": os.getloadavg()}


def machine_line(m: dict) -> str:
    la = m["loadavg_start"]
    end = m.get("loadavg_end")
    load = f"load average {la[0]:.2f} at start" + (f", {end[0]:.2f} at end" if end else "")
    return (f"{m['cpu']}, {m['cores']} cores, {m['gpu']}; torch {m['torch']}, deepspeed {m['deepspeed']}, "
            f"transformers {m['transformers']}, Python {m['python']}, {m['os']}; {load}")


def alternate(sides: dict[str, Callable[[int], dict]], rounds: int, log=print) -> dict[str, list[dict]]:
    """Run every side once per round, in order (A B A B ... or A B C A B C ...), so machine
    load drifts hit all sides alike; return each side's results in run order."""
    out: dict[str, list[dict]] = {name: [] for name in sides}
    for r in range(rounds):
        for name, fn in sides.items():
            t0 = time.perf_counter()
            result = fn(r)
            out[name].append(result)
            log(f"  round {r + 1}/{rounds} {name}: {_brief(result)} ({time.perf_counter() - t0:.0f}s)", flush=True)
    return out


def _brief(result: dict) -> str:
    return ", ".join(f"{k}={v:.4g}" for k, v in result.items() if isinstance(v, (int, float)))


def median_of(results: list[dict], key: str) -> float:
    return statistics.median(r[key] for r in results)


def steady_step_time(records: list[dict], skip: int) -> float:
    """Median ``step_time_s`` of the training records after the first ``skip`` steps (warm-up)."""
    times = [r["step_time_s"] for r in records if "step_time_s" in r and r["step"] > skip]
    if not times:
        raise RuntimeError(f"no step after the {skip} warm-up steps to measure")
    return statistics.median(times)


@dataclass
class CliRun:
    """One ``python -m hybridtrain`` run and what it wrote."""

    run_dir: Path
    returncode: int
    wall_s: float
    output: str
    marks: dict[str, float] = field(default_factory=dict)
    """Seconds from the launch to: the end of each of :data:`PHASES`, ``first step`` (the first
    line of ``metrics.jsonl`` appeared) and ``exit``."""

    cpu: dict[str, float] = field(default_factory=dict)
    """CPU seconds of each kind of process when the first step was written (:func:`tree_cpu`)."""

    def metrics(self) -> list[dict]:
        files = RunDir(self.run_dir)
        return files.metrics() if files.metrics_file.exists() else []


def run_hybridtrain(run_dir: Path, overrides: list[str], env: dict | None = None, timeout: float = 1800,
                    inject: bool = False, root: Path = ROOT) -> CliRun:
    """``python -m hybridtrain hydra.run.dir=RUN_DIR OVERRIDES`` from the repository root (``root``: another
    checkout's, first on ``PYTHONPATH``); stdout lines and the first ``metrics.jsonl`` line are time-stamped.
    ``inject`` puts ``bench/inject`` first on the workers' ``PYTHONPATH`` (its ``sitecustomize`` acts only
    when ``HT_BENCH_*`` is set)."""
    metrics = RunDir(run_dir).metrics_file
    marks: dict[str, float] = {}
    t0 = time.perf_counter()
    proc = cli.start(run_dir, overrides, env=env, path_first=([INJECT] if inject else []) + [root], cwd=root,
                     stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)
    done = threading.Event()

    cpu: dict[str, float] = {}

    def watch_metrics() -> None:
        while not done.is_set():
            if metrics.exists() and metrics.stat().st_size > 0:
                marks["first step"] = time.perf_counter() - t0
                cpu.update(tree_cpu(proc.pid))
                return
            time.sleep(0.02)

    watcher = threading.Thread(target=watch_metrics, daemon=True)
    watcher.start()
    lines = []
    deadline = time.monotonic() + timeout
    for line in proc.stdout:  # type: ignore[union-attr]
        now = time.perf_counter() - t0
        lines.append(line)
        for name, prefix in PHASES:
            if name not in marks and prefix in line:  # a progress bar on the merged stderr may precede it
                marks[name] = now
        if time.monotonic() > deadline:
            proc.kill()
            break
    code = proc.wait()
    marks["exit"] = time.perf_counter() - t0
    done.set()
    watcher.join()
    return CliRun(run_dir, code, marks["exit"], "".join(lines), marks, cpu)


ROLES = [("runner", ("deepspeed.launcher.runner",)), ("launch", ("deepspeed.launcher.launch",)),
         ("preload", ("hybridtrain.launch.preload",)), ("worker", ("hybridtrain.worker", "startup_deepspeed.py"))]
"""Kinds of process in a launch, by a fragment of their command line, first match after the forked
CPU ranks (:func:`hybridtrain.launch.ranks.rank_of`: they keep the preload process's command line)
and the preload process forked from the controller (its command line is the controller's); the
launcher's own command line names the worker's; anything else is the ``controller``."""


def tree_cpu(pid: int) -> dict[str, float]:
    """CPU seconds (user + system, reaped children included) used so far by process ``pid`` and its
    descendants, summed per kind (:data:`ROLES`), with ``worker_max`` (the busiest worker) and
    ``critical``: every process but the workers, plus the busiest worker. The preload process that
    forks the CPU ranks counts only its own time (its reaped children are ranks).

    On an idle machine the start-up is a chain (controller, runner, launcher, then the workers side
    by side), so ``critical`` approximates its wall time; other processes on a busy machine stretch
    wall time far more than CPU time, which makes this the steadier number for a ratio there."""
    import psutil

    from hybridtrain.launch.ranks import rank_of

    out = {"controller": 0.0, "launch": 0.0, "runner": 0.0, "preload": 0.0, "worker": 0.0, "worker_max": 0.0}
    try:
        root = psutil.Process(pid)
        procs, root_cmd = [root, *root.children(recursive=True)], root.cmdline()
    except psutil.Error:
        return {}
    for p in procs:
        try:
            t, cmd, forked = p.cpu_times(), p.cmdline(), rank_of(p) is not None
        except psutil.Error:
            continue
        if forked:
            role = "worker"
        elif p.pid != root.pid and cmd == root_cmd:  # forked from the controller: the preload process
            role = "preload"
        else:
            role = next((name for name, parts in ROLES if any(x in " ".join(cmd) for x in parts)), "controller")
        used = t.user + t.system + (0.0 if role == "preload" else t.children_user + t.children_system)
        out[role] += used
        if role == "worker":
            out["worker_max"] = max(out["worker_max"], used)
    out["critical"] = out["controller"] + out["launch"] + out["runner"] + out["preload"] + out["worker_max"]
    return out


def check(run: CliRun) -> CliRun:
    """Raise with the end of the output when the run failed."""
    if run.returncode != 0:
        raise RuntimeError(f"run in {run.run_dir} exited {run.returncode}:\n{run.output[-4000:]}")
    return run


def write_section(out: Path, name: str, section: dict, facts: dict, rounds: int, command: str) -> None:
    """A standalone benchmark's results: ``out/NAME_DATE.json`` (the section without its plot, the machine, the
    command) and ``out/NAME_DATE.md`` (title, machine, command, what was measured, the table, the summary), the
    markdown also printed. ``facts``: :func:`machine`'s, the load average at the end added here."""
    import datetime as dt
    import json

    facts["loadavg_end"] = os.getloadavg()
    date = dt.datetime.now()
    summary = {"date": date.isoformat(timespec="seconds"), "machine": machine_line(facts), "rounds": rounds,
               "command": command, **{k: v for k, v in section.items() if k != "plot"}}
    stamp = date.strftime("%Y-%m-%d_%H%M%S")
    out.mkdir(parents=True, exist_ok=True)
    (out / f"{name}_{stamp}.json").write_text(json.dumps(summary, indent=1))
    rows = section["table"]
    lines = [f"# {section['title']}, {summary['date']}", "", f"Machine: {summary['machine']}", "",
             f"Command: `{command}`", "", section["what"], "",
             "| " + " | ".join(rows[0]) + " |", "|" + "---|" * len(rows[0])]
    lines += ["| " + " | ".join(r) + " |" for r in rows[1:]] + ["", section["summary"]]
    (out / f"{name}_{stamp}.md").write_text("\n".join(lines) + "\n")
    print("\n".join(lines))
