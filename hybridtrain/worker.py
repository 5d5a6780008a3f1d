"""One training rank, started by the deepspeed runner: ``python -m hybridtrain.worker RUN_DIR``.

Reads the resolved ``config.yaml`` and ``plan.json`` the launcher wrote (Hydra never runs here),
joins the process group, builds its stage and tensor shard, trains, and exits.
"""
from __future__ import annotations

import json
import os
import sys
import time
from datetime import timedelta
from pathlib import Path


def _setup_threads() -> None:
    import torch

    threads = int(os.environ.get("HYBRIDTRAIN_THREADS", "0"))
    if threads > 0:
        torch.set_num_threads(threads)


def run(run_dir: Path) -> int:
    """Train one rank of the run in ``run_dir``; return the exit code."""
    t0 = time.perf_counter()
    import warnings

    import torch

    # DeepSpeed's ZeRO-1 calls a torch collective torch 2.13 marks deprecated; once per rank.
    warnings.filterwarnings("ignore", message=".*all_gather_into_tensor.*", category=FutureWarning)

    _setup_threads()
    import deepspeed
    from deepspeed.accelerator import get_accelerator

    from hybridtrain.config import load_config
    from hybridtrain.data.sampler import open_samples
    from hybridtrain.engine import build
    from hybridtrain.plan import model_config
    from hybridtrain.plan.validate import Plan
    from hybridtrain.train.loop import train

    cfg = load_config(run_dir / "config.yaml")
    plan = Plan(**json.loads((run_dir / "plan.json").read_text()))
    on_cpu = get_accelerator().device_name() == "cpu"
    if on_cpu:
        # DeepSpeed JIT-compiles a shared-memory op (25 s on a fresh machine) that only serves
        # inference all-reduce; training never calls it.
        import importlib

        # (``import deepspeed.comm.torch as m`` would bind the torch package re-exported there)
        importlib.import_module("deepspeed.comm.torch").build_shm_op = lambda: None
    deepspeed.init_distributed(dist_backend="gloo" if on_cpu else None,
                               timeout=timedelta(minutes=cfg.launcher.timeout_minutes))
    rank = int(os.environ.get("RANK", "0"))
    torch.manual_seed(cfg.trainer.seed)
    built = build(cfg, plan, model_config(cfg))
    samples = open_samples(run_dir / "data.json", "train", cfg.trainer.seed)  # memory-mapped, never re-tokenized
    if rank == 0:
        print(f"[hybridtrain] rank 0 ready in {time.perf_counter() - t0:.1f}s "
              f"(stage {built.stage}, tp_rank {built.tp_rank}, dp_rank {built.dp_rank}, "
              f"{built.model_state_bytes / 2**20:.1f} MiB of parameters)", flush=True)
    losses = train(cfg, plan, built, samples, run_dir, is_rank0=rank == 0)
    torch.distributed.barrier()  # nobody exits while a peer may still be in the last collective
    if rank == 0:
        print(f"[hybridtrain] done: {len(losses)} steps, loss {losses[0]:.4f} -> {losses[-1]:.4f}", flush=True)
    return 0


def main() -> None:
    if len(sys.argv) != 2:
        sys.exit("usage: python -m hybridtrain.worker RUN_DIR  (started by `python -m hybridtrain`)")
    try:
        code = run(Path(sys.argv[1]))
    except BaseException:  # noqa: BLE001 - report, then exit non-zero so the runner stops every rank
        import traceback

        traceback.print_exc()
        code = 1
    sys.stdout.flush()
    sys.stderr.flush()
    # Skip interpreter and gloo teardown (5-7 s on a loaded CPU): everything is written and flushed.
    os._exit(code)


if __name__ == "__main__":
    main()
