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
    from hybridtrain.train.preempt import StopRequest

    stop = StopRequest().install()  # first: a SIGTERM while starting up still ends in a checkpoint
    import warnings

    import torch

    # DeepSpeed's ZeRO-1 calls a torch collective torch 2.13 marks deprecated; once per rank.
    warnings.filterwarnings("ignore", message=".*all_gather_into_tensor.*", category=FutureWarning)

    _setup_threads()
    import deepspeed
    from deepspeed.accelerator import get_accelerator

    from hybridtrain.checkpoint.io import CheckpointDir
    from hybridtrain.data.sampler import open_samples
    from hybridtrain.engine import build
    from hybridtrain.parallel import collectives
    from hybridtrain.parallel.groups import time_out_groups_like_world
    from hybridtrain.plan import model_config
    from hybridtrain.rundir import RunDir
    from hybridtrain.train.loop import train

    files = RunDir(run_dir)
    cfg = files.config()
    plan = files.plan()
    on_cpu = get_accelerator().device_name() == "cpu"
    kept = False
    if on_cpu:
        # DeepSpeed JIT-compiles a shared-memory op (slow on a fresh machine, docs/benchmarks.md) that
        # only serves inference all-reduce; training never calls it.
        import importlib

        # (``import deepspeed.comm.torch as m`` would bind the torch package re-exported there)
        importlib.import_module("deepspeed.comm.torch").build_shm_op = lambda: None
        if cfg.launcher.keep_host_memory:  # reuse freed host memory (glibc only; elsewhere the default policy)
            from hybridtrain.host_memory import keep_freed_memory

            kept = keep_freed_memory()
    else:
        _setup_gpu(cfg)
    timeout = timedelta(minutes=cfg.launcher.timeout_minutes)
    deepspeed.init_distributed(dist_backend="gloo" if on_cpu else None, timeout=timeout)
    time_out_groups_like_world(timeout)  # DeepSpeed's sub-groups too, not torch's 10-minute NCCL default
    rank = int(os.environ.get("RANK", "0"))
    torch.manual_seed(cfg.trainer.seed)
    hf_config = model_config(cfg)
    resume = Path(cfg.trainer.resume) if cfg.trainer.resume else None  # the launcher checked it
    reshard = resume is not None and through_hf(_saved_plan(resume), plan, _saved_vocab(resume))
    # a LoRA run's adapters come from the checkpoint (same plan: DeepSpeed then loads the same values)
    adapters = CheckpointDir(resume).adapter if resume and cfg.finetune.method == "lora" else None
    built = build(cfg, plan, hf_config, weights_dir=str(CheckpointDir(resume).hf) if reshard else None,
                  adapter_dir=str(adapters) if adapters else None)
    samples = open_samples(files.data_file, "train", cfg.trainer.seed)  # memory-mapped, never re-tokenized
    if cfg.finetune.objective == "orpo":  # ORPO's NLL runs over the chosen prompt too (TRL's ORPOTrainer)
        samples.prompt_nll = True
    if cfg.finetune.objective == "dpo":  # before a checkpoint's weights load: the reference is the initial model
        from hybridtrain.train.preference import attach_reference

        attach_reference(cfg, plan, built, samples, json.loads(files.data_file.read_text())["dir"],
                         initial_weights=not reshard, is_rank0=rank == 0)
    start_step = _resume(built, plan, resume, reshard, rank) if resume else 0
    if rank == 0 and plan.nodes > 1:
        from hybridtrain.launch.placement import describe

        names = os.environ.get("HYBRIDTRAIN_NODES")  # set by the slurm / multinode launchers
        print(describe(plan, names.split(",") if names else None), flush=True)
    if rank == 0:
        held = built.model_state_bytes  # gradients appear with the first backward (see metrics.jsonl)
        print(f"[hybridtrain] rank 0 ready in {time.perf_counter() - t0:.1f}s "
              f"(stage {built.stage}, tp_rank {built.tp_rank}, dp_rank {built.dp_rank}); model state "
              f"{held['total'] / 2**20:.1f} MiB = params {held['params'] / 2**20:.1f} + grads "
              f"{held['grads'] / 2**20:.1f} + optimizer {held['optim'] / 2**20:.1f}"
              f"{'; freed host memory kept for reuse' if kept else ''}", flush=True)
    save = _saver(cfg, plan, built, hf_config, run_dir, rank, samples)
    losses = train(cfg, plan, built, samples, run_dir, is_rank0=rank == 0, start_step=start_step, save=save,
                   stop=stop, resumed_from=resume)
    collectives.barrier(built.engine.device)  # nobody exits while a peer may still be in the last collective
    if stop.stopped_at is not None:
        if rank == 0:
            _stopped(run_dir, stop)
        return 0
    if rank == 0 and losses:
        print(f"[hybridtrain] done: {len(losses)} steps, loss {losses[0]:.4f} -> {losses[-1]:.4f}", flush=True)
    if rank == 0 and cfg.trainer.export_hf:
        # after the last barrier: the other ranks have left and wait in no collective (whose timeout a
        # long export of a large model would exceed); the export reads only the final checkpoint
        _export(run_dir, cfg.trainer.max_steps)
    return 0


def _setup_gpu(cfg) -> None:
    """Bind this rank to its GPU before the process group starts (NCCL creates its communicator on
    the current device; DeepSpeed takes ``LOCAL_RANK`` as the device index), and let an fp32 run's
    matmuls use TF32 tensor cores when ``trainer.tf32`` (:func:`hybridtrain.gpus.uses_tf32`). The CUDA
    allocator gets expandable segments unless the environment configures it
    (:func:`~hybridtrain.gpus.allocator_settings`): read when CUDA starts, which ``set_device`` does."""
    import torch

    from hybridtrain.gpus import allocator_settings, uses_tf32

    allocator_settings(os.environ)
    torch.cuda.set_device(int(os.environ.get("LOCAL_RANK", "0")))
    if uses_tf32(cfg.trainer.precision, cfg.trainer.tf32):
        torch.set_float32_matmul_precision("high")  # TF32 for fp32 matmuls (cuBLAS); bf16/fp16 unaffected


def _export(run_dir: Path, step: int) -> None:
    """Rank 0, after training: the HF model of the final checkpoint into ``RUN_DIR/hf``."""
    from hybridtrain.checkpoint.io import step_dir
    from hybridtrain.export import export
    from hybridtrain.rundir import RunDir

    t0 = time.perf_counter()
    out = RunDir(run_dir).hf_dir
    export(step_dir(run_dir, step), out, overwrite=True)  # the run's own folder: a resumed run replaces its export
    print(f"[hybridtrain] exported the HF model to {out} in {time.perf_counter() - t0:.1f}s", flush=True)


def _stopped(run_dir: Path, stop) -> None:
    """Rank 0 after a signal stop: say so, and leave ``stopped.json`` for the launcher."""
    from hybridtrain.checkpoint.io import step_dir
    from hybridtrain.train.preempt import write_marker

    path = step_dir(run_dir, stop.stopped_at)
    write_marker(run_dir, stop.stopped_at, path)
    print(f"[hybridtrain] stopped by {stop.signal_name or 'a peer'} after step {stop.stopped_at}; "
          f"checkpoint {path}", flush=True)


def _saved_plan(checkpoint: Path) -> dict:
    from hybridtrain.checkpoint.io import CheckpointDir

    from hybridtrain.plan.types import saved_layout

    return saved_layout(CheckpointDir(checkpoint).meta()["plan"])


def _saved_vocab(checkpoint: Path) -> int:
    """The padded vocabulary the checkpoint was trained with (64 x tp rows on GPUs, tp on CPUs by
    default): a resume on the other kind of device goes through the HF names, like a plan change."""
    import json

    from hybridtrain.checkpoint.io import CheckpointDir

    return int(json.loads(CheckpointDir(checkpoint).plan_file.read_text())["padded_vocab_size"])


def through_hf(saved: dict, plan, saved_vocab: int) -> bool:
    """Whether a resume from a checkpoint of layout ``saved`` (``meta.json``'s plan) and padded vocabulary
    ``saved_vocab`` builds from its ``hf/`` and ``optim/`` (re-sharding) rather than DeepSpeed's ``ds/``: another
    layout or vocabulary padding, or expert parallelism on either side (``ds/`` holds data rank 0's experts only)."""
    return saved != plan.layout() or saved_vocab != plan.padded_vocab_size or max(saved.get("ep", 1), plan.dims.ep) > 1


def _resume(built, plan, checkpoint: Path, reshard: bool, rank: int) -> int:
    """Restore everything from ``checkpoint``; return the step to continue from.

    Same plan: DeepSpeed's own state (bit-exact), but the learning-rate schedule of this run. Another plan:
    weights were built from the checkpoint's HF-named tensors; the AdamW moments, step and schedule are set here.
    Either way the schedule is recomputed from this run's ``optim.*`` keys and ``trainer.max_steps``.
    """
    from hybridtrain.checkpoint.io import CheckpointDir
    from hybridtrain.checkpoint.save import load_verified, stage_hf_params

    step = int(CheckpointDir(checkpoint).meta()["step"])
    if reshard:
        from hybridtrain.checkpoint.reshard import load_moments, set_schedule

        params = [x for x in stage_hf_params(built.engine.module, include_replicas=True) if x[1].requires_grad]
        load_moments(built, params, CheckpointDir(checkpoint).optim, step, plan.padded_vocab_size)
        set_schedule(built.engine, plan, step)
    else:
        from hybridtrain.checkpoint.reshard import load_keeping_schedule

        # ds/ verified, then loaded weights-only (checkpoint/safe_load.py); the lr schedule stays this run's
        # (its optim.*, max_steps)
        load_keeping_schedule(built.engine, plan, step, lambda: load_verified(built, checkpoint, rank, plan.world_size))
    if rank == 0:
        saved = _saved_plan(checkpoint)
        same = saved == plan.layout() and _saved_vocab(checkpoint) == plan.padded_vocab_size
        how = ("same plan" if not reshard else "same plan, through hf/ and optim/: expert parallel" if same
               else f"re-sharded from {saved}")
        print(f"[hybridtrain] resumed from {checkpoint} at step {step} ({how})", flush=True)
    return step


def _saver(cfg, plan, built, hf_config, run_dir: Path, rank: int, samples):
    """The ``save(step)`` callback of the loop: a checkpoint (the HF export follows training, :func:`_export`)."""
    from hybridtrain.checkpoint.save import save_checkpoint
    from hybridtrain.data.tokenizer import tokenizer_file
    from hybridtrain.train.logits import logits_writer

    def save(step: int) -> None:
        t0 = time.perf_counter()
        extra = logits_writer(built, plan, samples, step) if cfg.trainer.save_logits else None
        path = save_checkpoint(built, cfg, plan, hf_config, step, run_dir, tokenizer_file(cfg.data), extra)
        if rank == 0:
            print(f"[hybridtrain] saved {path} in {time.perf_counter() - t0:.1f}s", flush=True)

    return save


def _slurm_gpus_missing() -> bool:
    """An ``srun`` task that SLURM gave GPUs but torch sees none (a CPU build on the node): say so."""
    from hybridtrain.launch.devices import slurm_gpus_expected

    if not slurm_gpus_expected(os.environ):
        return False
    import torch

    if torch.cuda.is_available():
        return False
    print(f"[hybridtrain] config error: launcher.gpus: SLURM gave this task {os.environ.get('SLURM_GPUS_ON_NODE')} "
          f"GPU(s) but torch {torch.__version__} on {os.uname().nodename} sees no CUDA device; install the CUDA "
          "build in the job's environment (launcher.setup, docs/gpu.md) or run CPU processes with launcher.gpus=false",
          file=sys.stderr, flush=True)
    return True


def run_or_report(run_dir: Path) -> int:
    """:func:`run` as a rank's whole life: an ``srun`` task first takes its place from SLURM's
    variables; any exception is printed and becomes exit code 1 (the launcher then ends every rank)."""
    try:
        from hybridtrain.launch.devices import hide_gpus

        hide_gpus(os.environ)  # CPU processes see no GPU, whatever their launcher exported (before torch looks)
        if os.environ.get("HYBRIDTRAIN_CONTROLLER"):  # started by the deepspeed runner: die with the controller
            from hybridtrain.launch.parent import LIFELINE_ENV, hold_lifeline, watch_controller

            # on the controller's host its pidfd; on another host (ssh) the controller's lifeline
            if not watch_controller(os.environ["HYBRIDTRAIN_CONTROLLER"]) and os.environ.get(LIFELINE_ENV):
                hold_lifeline(os.environ[LIFELINE_ENV])
        if os.environ.get("HYBRIDTRAIN_LAUNCHER") == "slurm":  # an srun task: RANK etc. from SLURM's variables
            from hybridtrain.launch import env

            env.apply(os.environ)
        missing = os.environ.get("HYBRIDTRAIN_LAUNCHER") == "slurm" and _slurm_gpus_missing()
        return 2 if missing else run(run_dir)
    except BaseException as err:  # noqa: BLE001 - report, then exit non-zero so the runner stops every rank
        from hybridtrain.checkpoint.io import CheckpointError

        if isinstance(err, CheckpointError):  # one line naming the file and the fix, no traceback
            rank = os.environ.get("RANK", "0")
            if not err.shared or rank == "0":
                print(f"[hybridtrain] rank {rank}: {err}", file=sys.stderr, flush=True)
            return 1
        import traceback

        traceback.print_exc()
        return 1


def main() -> None:
    from hybridtrain.versions import require_tested_versions

    require_tested_versions()  # this node's install, which on a cluster need not be the controller's
    if len(sys.argv) != 2:
        sys.exit("usage: python -m hybridtrain.worker RUN_DIR  (started by `python -m hybridtrain`)")
    code = run_or_report(Path(sys.argv[1]))
    sys.stdout.flush()
    sys.stderr.flush()
    # Skip interpreter and gloo teardown (seconds on a loaded CPU): everything is written and flushed.
    os._exit(code)


if __name__ == "__main__":
    main()
