"""The local launcher's CPU ranks, forked from one process that imported their libraries once.

``python -m hybridtrain.launch.preload RUN_DIR REPORT_FD``, started by the controller
(:meth:`hybridtrain.launch.ranks.Ranks.fork`), reads the ranks' environments (a JSON list) from
stdin, imports what a rank imports (torch, DeepSpeed, transformers and the model family's modeling
module, hybridtrain's engine and loop: :func:`warm`), then forks one child per environment. Each child
starts its own session, takes its environment and runs :func:`hybridtrain.worker.run_or_report`,
exactly what ``python -m hybridtrain.worker RUN_DIR`` runs. Through the pipe ``REPORT_FD`` the
process tells the controller each child's pid (one line per rank, in rank order) and then, as each
exits, ``PID CODE`` (``CODE`` as :attr:`subprocess.Popen.returncode` gives it: ``-N`` for signal N).

Why by hand: every rank otherwise spends 7-10 s of CPU importing the same modules (transformers'
modeling imports alone take ~7 s: ``torch._dynamo``, ``torch.distributed.tensor``, scipy), so an
8-rank job on a 2-core machine waited ~40 s before its first step. ``multiprocessing``'s forkserver
would do the forking, but its children are its own ``Process`` objects, not processes with their own
environment, session and exit code that :class:`~hybridtrain.launch.ranks.Ranks` supervises like the
GPU path's ``Popen`` ranks; DeepSpeed's and torch's launchers start each rank as a new interpreter.

Only CPU ranks are forked (:func:`hybridtrain.launch.local.launch`): nothing here has initialised
CUDA, but a forked GPU rank has never been run. ``HYBRIDTRAIN_PRELOAD=0`` starts every rank as its
own interpreter instead.
"""
from __future__ import annotations

import gc
import importlib
import json
import os
import signal
import sys
from pathlib import Path


def warm(run_dir: Path) -> None:
    """Import every module a rank of the run in ``run_dir`` imports before its first step, and nothing
    more: no tensor is made, no thread pool started, no device touched (all of that happens per rank)."""
    import warnings

    warnings.filterwarnings("ignore", message=".*all_gather_into_tensor.*", category=FutureWarning)
    import deepspeed  # noqa: F401
    import deepspeed.runtime.pipe.engine  # noqa: F401
    import pyarrow.compute  # noqa: F401  (the ranks' data reads: ListArray.flatten imports it)

    import hybridtrain.checkpoint.save  # noqa: F401
    import hybridtrain.data.sampler  # noqa: F401
    import hybridtrain.engine  # noqa: F401
    import hybridtrain.engine.pipeline  # noqa: F401
    import hybridtrain.observe.observer  # noqa: F401
    import hybridtrain.train.loop  # noqa: F401
    from hybridtrain.plan import model_config
    from hybridtrain.rundir import RunDir

    files = RunDir(run_dir)
    config_module = type(model_config(files.config())).__module__  # transformers.models.X.configuration_X
    optional = [config_module.replace(".configuration_", ".modeling_"),  # the family's modules
                # deepspeed.initialize's expert-parallel check imports these two (~0.3 s of CPU per rank)
                "deepspeed.module_inject.auto_ep_config", "deepspeed.module_inject.auto_ep_layer"]
    plan = files.plan()
    if plan.zero_stage > 0 or plan.precision != "fp32":
        # DeepSpeed's ZeRO and BF16 optimizers import Muon's, which calls torch.compile at import
        # (torch._inductor: ~0.8 s of CPU); an fp32 run without ZeRO never does, so it is not warmed then
        optional.append("deepspeed.runtime.zero.muon.muon_optimizer")
    for name in optional:
        try:
            importlib.import_module(name)
        except ImportError:  # named otherwise in this version: the rank imports what it needs itself
            pass


def rank_name(rank: int) -> str:
    """The process name (``/proc/PID/comm``, what ``top`` and ``ps -o comm`` show) of forked rank ``rank``.
    A forked rank keeps the preload process's command line and its ``/proc/PID/environ`` (which shows
    the environment a process was started with, not ``RANK``): this name is how tools outside tell
    the ranks apart (:func:`hybridtrain.launch.ranks.rank_of`)."""
    return f"hybridtrain-r{rank}"[:15]  # the kernel keeps 15 bytes


def _name(name: str) -> None:
    """Set this process's name (``prctl(PR_SET_NAME)``; Linux only, like forking the ranks)."""
    import ctypes

    ctypes.CDLL(None, use_errno=True).prctl(15, name.encode(), 0, 0, 0)  # 15: PR_SET_NAME


def _child(run_dir: Path, env: dict[str, str], report: int) -> None:
    """In a forked child: become rank ``env["RANK"]`` and run it; never returns."""
    code = 1
    try:
        os.close(report)
        os.setsid()  # its own process group, like a Popen rank with start_new_session
        signal.signal(signal.SIGINT, signal.SIG_DFL)
        signal.signal(signal.SIGTERM, signal.SIG_DFL)
        os.environ.clear()
        os.environ.update(env)  # also the C environment (gloo, OpenMP read it there)
        _name(rank_name(int(env["RANK"])))
        from hybridtrain import worker

        sys.argv = [worker.__file__, str(run_dir)]
        code = worker.run_or_report(run_dir)
    except BaseException:  # noqa: BLE001 - report, exit non-zero: the controller ends the other ranks
        import traceback

        traceback.print_exc()
    finally:
        sys.stdout.flush()
        sys.stderr.flush()
        os._exit(code)  # as the worker does: no interpreter teardown, and never back into main()


def main() -> None:
    if len(sys.argv) != 3:
        sys.exit("usage: python -m hybridtrain.launch.preload RUN_DIR REPORT_FD  (started by `python -m hybridtrain`)")
    run_dir, report = Path(sys.argv[1]), int(sys.argv[2])
    envs = json.load(sys.stdin)
    warm(run_dir)
    # What the children inherit is never collected there: a collection in a child would touch (and so
    # copy) every page of the inherited heap; frozen, the children share those pages (gc.freeze docs).
    gc.freeze()
    # From here on the controller talks to the ranks, not to this process (a Ctrl-C while importing
    # still ends it: the controller forwards signals here until every rank exists).
    signal.signal(signal.SIGINT, signal.SIG_IGN)
    signal.signal(signal.SIGTERM, signal.SIG_IGN)
    sys.stdout.flush()
    sys.stderr.flush()
    pids = []
    for env in envs:
        pid = os.fork()
        if pid == 0:
            _child(run_dir, env, report)
        pids.append(pid)
        os.write(report, f"{pid}\n".encode())
    left = set(pids)
    while left:
        pid, status = os.wait()
        if pid in left:
            left.discard(pid)
            os.write(report, f"{pid} {os.waitstatus_to_exitcode(status)}\n".encode())
    os.close(report)
    sys.stdout.flush()
    sys.stderr.flush()
    os._exit(0)  # tearing down torch, DeepSpeed and transformers takes ~2 s and leaves nothing to write


if __name__ == "__main__":
    main()
