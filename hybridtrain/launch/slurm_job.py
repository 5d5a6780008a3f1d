"""Steps the SLURM job script runs on its first node, outside ``srun``.

``python -m hybridtrain.launch.slurm_job resume RUN_DIR``: on a requeued (or restarted) job, point
``trainer.resume`` in ``RUN_DIR/config.yaml`` at the newest complete checkpoint of the run, as
``trainer.resume=auto`` would, so the ranks continue where the stopped job saved.
"""
from __future__ import annotations

import json
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
    from hybridtrain.config import load_config, save_config
    from hybridtrain.plan import model_config
    from hybridtrain.plan.validate import Plan

    cfg = load_config(run_dir / "config.yaml")
    plan = Plan(**json.loads((run_dir / "plan.json").read_text()))
    cfg.trainer.resume = "auto"
    found = resolve_resume(cfg, plan, model_config(cfg), run_dir)
    if found is None:
        return None
    cfg.trainer.resume = str(found)
    save_config(cfg, run_dir / "config.yaml")
    return found


def main(argv: list[str]) -> int:
    if len(argv) != 2 or argv[0] != "resume":
        print("usage: python -m hybridtrain.launch.slurm_job resume RUN_DIR  (run by the job script)", file=sys.stderr)
        return 2
    from hybridtrain.plan.validate import PlanError

    try:
        found = resume(Path(argv[1]), os.environ)
    except PlanError as err:
        print(f"[hybridtrain] cannot resume the requeued job: {err}", file=sys.stderr)
        return 1
    restarts = os.environ.get("SLURM_RESTART_COUNT", "0")
    if found is not None:
        print(f"[hybridtrain] restart {restarts}: resuming from {found}", flush=True)
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
