"""What the SLURM job script runs on its first node before ``srun`` starts the ranks.

``python -m hybridtrain.launch.slurm_job start RUN_DIR``:

- :func:`prepare_data`: when ``RUN_DIR/data.json`` is missing (the script was written with
  ``launcher.submit=false``), tokenize and check the data as the controller would have;
- :func:`resume`: on a requeued (or restarted) job, point ``trainer.resume`` in ``config.yaml``
  at the newest complete checkpoint of the run, as ``trainer.resume=auto`` would, so the ranks
  continue where the stopped job saved.
"""
from __future__ import annotations

import os
import sys
from pathlib import Path
from typing import Mapping, Optional


def resume(run_dir: Path, environ: Mapping[str, str]) -> Optional[Path]:
    """On a restart (``SLURM_RESTART_COUNT`` > 0) with a checkpoint in ``run_dir``: set ``trainer.resume``
    to it in ``config.yaml`` and return it; otherwise change nothing and return ``None``."""
    if int(environ.get("SLURM_RESTART_COUNT", "0") or 0) == 0:
        return None
    from hybridtrain.checkpoint.resume import resolve_resume
    from hybridtrain.plan import model_config
    from hybridtrain.rundir import RunDir

    files = RunDir(run_dir)
    cfg, plan = files.config(), files.plan()
    cfg.trainer.resume = "auto"
    found = resolve_resume(cfg, plan, model_config(cfg), run_dir)
    if found is None:
        return None
    cfg.trainer.resume = str(found)
    files.write_config(cfg)
    return found


def prepare_data(run_dir: Path) -> bool:
    """Write ``RUN_DIR/data.json`` (and the step count ``trainer.epochs`` derives) if it is missing;
    return whether it did. Raises ``PlanError`` for data that cannot train this plan."""
    from hybridtrain.rundir import RunDir

    files = RunDir(run_dir)
    if files.data_file.is_file():
        return False
    from hybridtrain.data.preference import tokenization_of
    from hybridtrain.data.prepare import prepare
    from hybridtrain.plan.data import check_data_counts

    from hybridtrain.errors import PlanError
    from hybridtrain.launch.cachedir import check_caches

    cfg, plan = files.config(), files.plan()
    problem = check_caches(cfg.data.cache_dir)  # this node's cache folders: the controller did not probe them
    if problem is not None:
        key, _, message = problem.partition(": ")
        raise PlanError(key, message)
    prepared = prepare(cfg.data, cfg.trainer.seed, pairs=tokenization_of(cfg.finetune.objective))
    cfg.trainer.max_steps = check_data_counts(cfg, plan, prepared.num_samples("train"), prepared.num_samples("val"))
    files.write_config(cfg)
    files.write_data(prepared)
    return True


def main(argv: list[str]) -> int:
    if len(argv) != 2 or argv[0] != "start":
        print("usage: python -m hybridtrain.launch.slurm_job start RUN_DIR  (run by the job script)", file=sys.stderr)
        return 2
    from hybridtrain.errors import PlanError
    from hybridtrain.rundir import RunDir

    run_dir = Path(argv[1])
    try:
        if prepare_data(run_dir):
            print(f"[hybridtrain] data prepared: {RunDir(run_dir).data_file}", flush=True)
    except PlanError as err:
        print(f"[hybridtrain] config error: {err}", file=sys.stderr)
        return 2
    try:
        found = resume(run_dir, os.environ)
    except PlanError as err:
        print(f"[hybridtrain] cannot resume the requeued job: {err}", file=sys.stderr)
        return 1
    restarts = os.environ.get("SLURM_RESTART_COUNT", "0")
    if found is not None:
        print(f"[hybridtrain] restart {restarts}: resuming from {found}", flush=True)
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
