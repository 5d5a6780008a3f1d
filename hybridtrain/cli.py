"""The command line from Python: compose the config as ``python -m hybridtrain`` would, and start
``python -m hybridtrain hydra.run.dir=RUN_DIR OVERRIDES`` as a subprocess.

What :mod:`hybridtrain.verify`, the tests and ``bench/`` share. Light on purpose: importing this
module imports neither torch nor deepspeed (Hydra only when composing).

- :func:`compose` / :func:`compose_raw`: Hydra's compose API over ``conf/`` with the schema registered.
- :func:`run`: a run to the end, output captured, with a timeout; :func:`describe` is its failure
  message (the command, the exit code and the end of the output).
- :func:`start`: the process, for a caller that reads its output as it comes; :class:`Background`:
  a run in the background writing its output to files, collected by :meth:`Background.result`.
"""
from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path
from typing import Any, Mapping, Sequence

from hybridtrain.config import CONF_DIR, Config, register_schema, to_config

REPO = CONF_DIR.parent
"""The checkout this package belongs to (``conf/``, ``recipes/``, ``bench/`` lie there)."""
TAIL = 6000
"""Characters of stdout and of stderr a failure message shows."""
WARM_START = "HYBRIDTRAIN_WARM_START"
"""Names the socket of a warm-start server (:mod:`hybridtrain.warmstart`) :func:`run` starts its runs from; a run
whose environment is not the server's starts as a fresh interpreter."""


def compose_raw(overrides: Sequence[str]):
    """The ``DictConfig`` Hydra composes from ``conf/`` with ``overrides``, as the CLI would."""
    from hydra import compose as hydra_compose, initialize_config_dir

    register_schema()
    with initialize_config_dir(config_dir=str(CONF_DIR), version_base="1.3"):
        return hydra_compose("config", overrides=list(overrides))


def compose(overrides: Sequence[str]) -> Config:
    """The typed :class:`~hybridtrain.config.Config` of ``overrides`` (e.g. ``["+recipe=gpt_tiny"]``); no launch."""
    return to_config(compose_raw(overrides))


def command(run_dir: Path | str | None, overrides: Sequence[str]) -> list[str]:
    """``python -m hybridtrain [hydra.run.dir=RUN_DIR] OVERRIDES`` with this interpreter (no
    ``hydra.run.dir`` when ``run_dir`` is ``None``: a sweep, or one given in ``overrides``)."""
    flags = [o for o in overrides if o.startswith("-")]  # Hydra's options (-m, --cfg) go before any override
    rest = [o for o in overrides if not o.startswith("-")]
    return [sys.executable, "-m", "hybridtrain", *flags,
            *([f"hydra.run.dir={run_dir}"] if run_dir is not None else []), *rest]


def environment(env: Mapping[str, str] | None = None, path_first: Sequence[Path | str] = ()) -> dict[str, str]:
    """This process's environment for a run: unbuffered output, ``path_first`` then this checkout first on
    ``PYTHONPATH`` (the run imports this package, whatever the working folder), then ``env`` on top."""
    paths = [*map(str, path_first), str(REPO), os.environ.get("PYTHONPATH", "")]
    out = dict(os.environ, PYTHONUNBUFFERED="1", PYTHONPATH=os.pathsep.join(p for p in paths if p))
    out.update(env or {})
    return out


def start(run_dir: Path | str | None, overrides: Sequence[str], *, env: Mapping[str, str] | None = None,
          path_first: Sequence[Path | str] = (), cwd: Path | str | None = None, **popen: Any) -> subprocess.Popen:
    """Start ``python -m hybridtrain`` (:func:`command`) and return the process; ``popen`` goes to
    :class:`subprocess.Popen` (``stdout=``, ``stderr=``, ``text=``...)."""
    return subprocess.Popen(command(run_dir, overrides), cwd=cwd, env=environment(env, path_first), **popen)


class RunFailed(AssertionError):
    """A run that exited non-zero; the message is :func:`describe` (an ``AssertionError``, so that a
    test shows it as the failed check it is)."""


def describe(proc: subprocess.CompletedProcess, tail: int = TAIL) -> str:
    """The command, its exit code and the last ``tail`` characters of its stdout and of its stderr."""
    cmd = proc.args if isinstance(proc.args, str) else " ".join(map(str, proc.args))
    return (f"{cmd} exited {proc.returncode}\n--- stdout\n{(proc.stdout or '')[-tail:]}"
            f"\n--- stderr\n{(proc.stderr or '')[-tail:]}")


def run(run_dir: Path | str | None, overrides: Sequence[str], *, timeout: float | None = None,
        env: Mapping[str, str] | None = None, cwd: Path | str | None = None,
        check: bool = False) -> subprocess.CompletedProcess:
    """Run ``python -m hybridtrain`` to the end, stdout and stderr captured as text; with ``check`` a
    non-zero exit raises :class:`RunFailed`. ``timeout`` (seconds) kills it and raises
    :class:`subprocess.TimeoutExpired`. With :data:`WARM_START` set, a warm-start server forks the run
    (:mod:`hybridtrain.warmstart`: what ``python -m hybridtrain`` runs, without importing its libraries again)."""
    args, full = command(run_dir, overrides), environment(env)
    proc = None
    if os.environ.get(WARM_START):  # a warm-start server of this process (tests, sweeps): the same run, forked
        from hybridtrain import warmstart

        proc = warmstart.run(os.environ[WARM_START], args, full, cwd, timeout)
    if proc is None:
        proc = subprocess.run(args, cwd=cwd, env=full, capture_output=True, text=True, timeout=timeout)
    if check and proc.returncode != 0:
        raise RunFailed(describe(proc))
    return proc


class Background:
    """``python -m hybridtrain`` started in the background; :meth:`result` waits for it.

    Stdout and stderr go to ``stdout.txt`` and ``stderr.txt`` in ``output`` (a full pipe never
    blocks a run), so many runs can start at once, each spending its seconds importing torch in
    parallel with the others; with :data:`WARM_START` set, the warm-start server forks it as it does
    :func:`run`'s (then without those seconds).
    """

    def __init__(self, run_dir: Path | str | None, overrides: Sequence[str], output: Path, *,
                 env: Mapping[str, str] | None = None, cwd: Path | str | None = None):
        output = Path(output)
        output.mkdir(parents=True, exist_ok=True)
        self.args = command(run_dir, overrides)
        self._out, self._err = output / "stdout.txt", output / "stderr.txt"
        with open(self._out, "w") as out, open(self._err, "w") as err:
            self._proc = None
            if os.environ.get(WARM_START):  # as in run(): forked by the warm-start server when it serves the env
                from hybridtrain import warmstart

                self._proc = warmstart.start(os.environ[WARM_START], self.args, environment(env), cwd,
                                             out.fileno(), err.fileno())
            if self._proc is None:
                self._proc = start(run_dir, overrides, env=env, cwd=cwd, stdout=out, stderr=err, text=True)
        self._done: subprocess.CompletedProcess | None = None

    def result(self, timeout: float = 180) -> subprocess.CompletedProcess:
        """The finished run (``returncode``, ``stdout``, ``stderr``); kills it after ``timeout`` seconds."""
        if self._done is None:
            try:
                self._proc.wait(timeout=timeout)
            except subprocess.TimeoutExpired:
                self._proc.kill()
                self._proc.wait()
                raise
            self._done = subprocess.CompletedProcess(self.args, self._proc.returncode,
                                                     self._out.read_text(), self._err.read_text())
        return self._done

    def kill(self) -> None:
        """End the run if it is still going (fixture teardown)."""
        if self._proc.poll() is None:
            self._proc.kill()
            self._proc.wait()
