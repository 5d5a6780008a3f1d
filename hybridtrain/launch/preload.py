"""The local launcher's CPU ranks, forked from one process that imported their libraries once.

The controller forks the preload process (:func:`fork_preloader`) as soon as its config is typed,
having imported torch and transformers' configuration code, which it needs to plan; the process waits
for its job (:meth:`Preloader.start`, from :meth:`hybridtrain.launch.ranks.Ranks.fork`): the ranks'
environments. It then imports what a rank imports (DeepSpeed, transformers and the model family's
modeling module, hybridtrain's engine and loop: :func:`warm`) and forks one child per environment
(:func:`serve`). Each child starts its own session, takes its environment and runs
:func:`hybridtrain.worker.run_or_report`, exactly what ``python -m hybridtrain.worker RUN_DIR`` runs.
Through its socket the process tells the controller each child's pid (one line per rank, in rank
order) and then, as each exits, ``PID CODE`` (``CODE`` as :attr:`subprocess.Popen.returncode` gives
it: ``-N`` for signal N).

Why by hand: every rank otherwise spends seconds of CPU importing the same modules (transformers'
modeling imports most: ``torch._dynamo``, ``torch.distributed.tensor``, scipy), so a job of many ranks
on few cores waited long before its first step (``docs/benchmarks.md``). ``multiprocessing``'s forkserver
would do the forking, but its children are its own ``Process`` objects, not processes with their own
environment, session and exit code that :class:`~hybridtrain.launch.ranks.Ranks` supervises like the
GPU path's ``Popen`` ranks; DeepSpeed's and torch's launchers start each rank as a new interpreter.

The preload process dies with the controller and each forked rank with the preload process, whatever
kills them (:mod:`hybridtrain.launch.parent`). Only CPU ranks are forked (:func:`hybridtrain.launch.local.launch`): nothing here has initialised
CUDA, but a forked GPU rank has never been run. ``HYBRIDTRAIN_PRELOAD=0`` starts every rank as its
own interpreter instead.
"""
from __future__ import annotations

import gc
import importlib
import io
import json
import os
import signal
import sys
from pathlib import Path
from typing import NoReturn


def warm_common() -> None:
    """Import the modules every rank imports before its first step, whatever its model (DeepSpeed, its
    pipeline engine, hybridtrain's engine, loop and checkpointing): no tensor is made, no thread pool started."""
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


OPTIONAL = ("deepspeed.module_inject.auto_ep_config", "deepspeed.module_inject.auto_ep_layer")
"""Imported by deepspeed.initialize's expert-parallel check in every rank (optional: named otherwise in
another DeepSpeed version)."""
MUON = "deepspeed.runtime.zero.muon.muon_optimizer"
"""Imported by DeepSpeed's ZeRO and BF16 optimizers: it calls torch.compile at import (torch._inductor, a
costly import), so an fp32 run without ZeRO, which never imports it, does not warm it."""


def import_optional(names) -> None:
    """Import each module of ``names`` that this version has (a rank imports what it needs itself)."""
    for name in names:
        try:
            importlib.import_module(name)
        except ImportError:
            pass


def modeling_module(hf_config) -> str:
    """The name of the transformers module of ``hf_config``'s model classes."""
    return type(hf_config).__module__.replace(".configuration_", ".modeling_")  # transformers.models.X.*_X


def warm(run_dir: Path) -> None:
    """Import every module a rank of the run in ``run_dir`` imports before its first step, and nothing
    more: no tensor is made, no thread pool started, no device touched (all of that happens per rank)."""
    warm_common()
    from hybridtrain.plan import model_config
    from hybridtrain.rundir import RunDir

    files = RunDir(run_dir)
    modeling = modeling_module(model_config(files.config()))
    plan = files.plan()
    import_optional([modeling, *OPTIONAL, *([MUON] if plan.zero_stage > 0 or plan.precision != "fp32" else [])])


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


def _child(run_dir: Path, env: dict[str, str], report: int, die_with_parent) -> None:
    """In a forked child: become rank ``env["RANK"]`` and run it (killed when this process's parent,
    the preload process, exits: ``die_with_parent``); never returns."""
    code = 1
    try:
        die_with_parent()
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
        os._exit(code)  # as the worker does: no interpreter teardown, and never back into serve()


def serve(run_dir: Path, envs: list[dict[str, str]], report: int) -> NoReturn:
    """Import what the ranks need (:func:`warm`), fork one rank per environment in ``envs``, write each
    rank's pid and then ``PID CODE`` as it exits to the file descriptor ``report``; never returns."""
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
    from hybridtrain.launch.parent import parent_death

    die_with_parent = parent_death()  # forks on this (the main) thread: the signal follows the forking thread
    pids = []
    for env in envs:
        pid = os.fork()
        if pid == 0:
            _child(run_dir, env, report, die_with_parent)
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
    os._exit(0)  # tearing down torch, DeepSpeed and transformers takes seconds and leaves nothing to write


class Preloader:
    """The preload process forked from the controller (:func:`fork_preloader`) before it plans: it has
    imported torch and transformers there once, for the controller and the ranks together, and waits
    for its job (:meth:`start`). What :class:`~hybridtrain.launch.ranks.Ranks` uses of a ``Popen``
    (``pid``, ``poll``, ``wait``, ``send_signal``). If the controller ends without starting it (a
    config error), the process sees its socket close and exits."""

    def __init__(self, pid: int, sock):
        self.pid, self._sock, self.returncode = pid, sock, None

    def start(self, run_dir: Path, env: dict[str, str], envs: list[dict[str, str]], stdout: int | None):
        """Send the job: the environment ``env`` (the process's own, as a ``Popen`` would set it), one
        environment per rank, the run directory, and ``stdout`` (a file descriptor, or None: the
        controller's). Return the binary stream of the process's pid and exit-code lines (:func:`serve`)."""
        import socket

        socket.send_fds(self._sock, [b"\0"], [stdout] if stdout is not None else [])
        self._sock.sendall(json.dumps({"run_dir": str(run_dir), "env": dict(env), "envs": list(envs)}).encode())
        self._sock.shutdown(socket.SHUT_WR)
        reports = self._sock.makefile("rb")
        self._sock.close()  # the stream keeps the socket open
        return reports

    def poll(self) -> int | None:
        return self._reap(os.WNOHANG)

    def wait(self) -> int:
        return self._reap(0)

    def _reap(self, flags: int) -> int | None:
        if self.returncode is None:
            try:
                pid, status = os.waitpid(self.pid, flags)
            except ChildProcessError:  # reaped elsewhere (psutil's wait_procs): as Popen, count it as 0
                pid, status = self.pid, 0
            if pid:
                self.returncode = os.waitstatus_to_exitcode(status)
        return self.returncode

    def send_signal(self, signum: int) -> None:
        if self.poll() is None:
            os.kill(self.pid, signum)


def fork_preloader() -> Preloader | None:
    """Import torch and transformers' configuration classes here (the controller imports them to plan
    anyway), then fork the preload process from this one, so neither it nor the ranks import them again
    (``docs/benchmarks.md``). None on a machine with CUDA: GPU ranks are never forked.

    Safe to fork as :func:`serve` is: so far this process has only imported modules and composed the
    config (no tensor made, no thread pool of torch's started; numpy's OpenBLAS thread, which ``import
    torch`` starts, stops itself around a fork). Call it before anything else: the planner's first
    torch calls start OpenMP's threads, which a forked child could not use."""
    import socket

    import torch
    from transformers import AutoConfig  # noqa: F401  (the planner's; it imports transformers' configuration code)

    if torch.cuda.is_available():
        return None
    from hybridtrain.launch.parent import parent_death

    die_with_controller = parent_death()  # the controller forks on its main thread (Hydra runs the job there)
    mine, its = socket.socketpair()
    gc.freeze()  # the controller's collections then leave the pages it shares with the fork alone
    sys.stdout.flush()
    sys.stderr.flush()
    pid = os.fork()
    if pid == 0:
        die_with_controller()  # and with it the ranks, which die with this process
        mine.close()
        _preloader(its)
    its.close()
    return Preloader(pid, mine)


def _preloader(sock) -> NoReturn:
    """In the forked preload process: wait for the job (:meth:`Preloader.start`), take what a process
    the controller started for it would have (its environment, stdin, stdout, a session of its own),
    then :func:`serve`; never returns."""
    import socket

    code = 1
    try:
        os.setsid()  # the terminal's Ctrl-C reaches only the controller, which forwards it
        signal.signal(signal.SIGINT, signal.SIG_DFL)
        signal.signal(signal.SIGTERM, signal.SIG_DFL)
        head, fds, _, _ = socket.recv_fds(sock, 1, 1)
        if not head:  # the controller ended (or went on) without it
            code = 0
            return
        body = b"".join(iter(lambda: sock.recv(1 << 16), b""))
        job = json.loads(body)
        os.environ.clear()
        os.environ.update(job["env"])
        null = os.open(os.devnull, os.O_RDONLY)
        os.dup2(null, 0)
        os.close(null)
        if fds:
            os.dup2(fds[0], 1)
            os.close(fds[0])
        # as `python -u` (what a rank started as its own interpreter runs with): the ranks' lines unbuffered
        sys.stdout = io.TextIOWrapper(io.FileIO(1, "w", closefd=False), encoding=sys.stdout.encoding,
                                      write_through=True)
        sys.stderr = io.TextIOWrapper(io.FileIO(2, "w", closefd=False), encoding=sys.stderr.encoding,
                                      errors="backslashreplace", write_through=True)
        import logging

        logging.root.handlers.clear()  # Hydra's, which write the controller's log: a new interpreter has none
        logging.root.setLevel(logging.WARNING)
        serve(Path(job["run_dir"]), job["envs"], sock.detach())
    except BaseException:  # noqa: BLE001 - the controller reads the missing pids as a failed start
        import traceback

        traceback.print_exc()
    finally:
        try:
            sys.stdout.flush()
            sys.stderr.flush()
        finally:
            os._exit(code)
