"""Warm starts of ``python -m hybridtrain``: a process that imported the controller's and the ranks' libraries
once forks each run, which then runs exactly what ``python -m hybridtrain ARGS`` runs.

Why: a run's controller spends seconds of CPU importing torch, transformers and Hydra, and its preload process
as many importing DeepSpeed and the modeling code, before it plans a step (``docs/benchmarks.md``); a test
suite or a sweep that starts hundreds of short runs spends most of its time there. Python has no such server:
``multiprocessing``'s forkserver gives its children no environment, working folder, descriptors or exit code of
their own, and the ranks' preload (:mod:`hybridtrain.launch.preload`) lives for one run.

``python -m hybridtrain.warmstart SOCKET`` imports (:func:`warm`) and listens on the UNIX socket ``SOCKET``.
For each request (:func:`request`: the command line's arguments, working folder, environment and umask, and
its stdin, stdout and stderr as descriptors) it forks a watcher, which forks the run: the run takes the
descriptors, folder and umask and runs the ``hybridtrain`` module as ``__main__`` (:mod:`runpy`, as ``-m``
does). The watcher reports the run's pid, then its exit code (as :attr:`subprocess.Popen.returncode` gives
it), and kills the run if the requester goes away first. A request whose environment is not the server's
own is refused (libraries read some of it at import), and the requester starts a fresh interpreter
instead; so is every request once a file of the ``hybridtrain`` package changed since the server imported it
(an edit while a test session runs: the fork would mix the old code of what the server imported with the new
code of what the run imports later). The run's preload process and ranks fork from the run as usual and die with it
(:mod:`hybridtrain.launch.parent`).

Safe to fork for the reason the preload process is: the server has only imported modules, started no
thread and made no tensor.
"""
from __future__ import annotations

import gc
import json
import os
import signal
import socket
import struct
import sys
from pathlib import Path
from typing import NoReturn, Sequence

HEADER = struct.Struct("!I")


def warm() -> None:
    """Import what a run's controller and its ranks import, for every family: nothing runs, no thread starts."""
    import hybridtrain.__main__  # noqa: F401  (torch, transformers, Hydra, the planner)
    from transformers import CONFIG_MAPPING

    from hybridtrain.launch import preload
    from hybridtrain.models.families import FAMILIES

    preload.warm_common()
    modeling = []
    for model_type in FAMILIES:
        try:
            modeling.append(CONFIG_MAPPING[model_type].__module__.replace(".configuration_", ".modeling_"))
        except KeyError:  # a family transformers names otherwise: its run imports it
            continue
    preload.import_optional([*modeling, *preload.OPTIONAL, preload.MUON])


class Server:
    """A warm-start server (``python -m hybridtrain.warmstart SOCKET``) for this process's runs, its socket in
    ``folder``, started with ``env`` (the environment a run of :func:`hybridtrain.cli.run` gets,
    ``hybridtrain.cli.environment(None)``), dying with this process; :meth:`close` stops it."""

    def __init__(self, folder: Path, env: dict[str, str]):
        import subprocess

        from hybridtrain.launch.parent import parent_death

        self.path = Path(folder) / "warm.sock"  # a UNIX socket's path: at most 107 bytes
        self.env = dict(env)
        self._proc = subprocess.Popen([sys.executable, "-m", "hybridtrain.warmstart", str(self.path)], env=self.env,
                                      stdin=subprocess.DEVNULL, stdout=subprocess.PIPE, text=True,
                                      preexec_fn=parent_death())
        self.pid = self._proc.pid  # the server's process id (the runs it forks are its descendants)
        for line in self._proc.stdout:  # the libraries' import-time notes, then "ready"
            if line.strip() == "ready":
                break
        else:
            raise RuntimeError(f"the warm-start server did not start (exit code {self._proc.wait()})")

    def close(self) -> None:
        """Stop the server (runs it started go on; each dies with its own watcher's requester)."""
        if self._proc.poll() is None:
            self._proc.kill()
            self._proc.wait()
        self._proc.stdout.close()


class Environment:
    """The environment the server started with, and what its imports added to it (torch sets
    ``TORCHINDUCTOR_CACHE_DIR`` and ``PYTORCH_NVML_BASED_CUDA_CHECK``, as it would in any process that imports it)."""

    UNREAD = ("PYTEST_CURRENT_TEST",)
    """Variables no library reads at import, which may differ: the test pytest runs (it sets the variable for
    each test)."""

    OWN = "HYBRIDTRAIN_"
    """hybridtrain's own variables (the cache root, the threads, the warm-start socket...), which may differ too:
    hybridtrain reads them when a run needs them, never at import (``tests/unit/test_warmstart_rules.py``), and no
    library reads them."""

    def __init__(self, started: dict[str, str], imported: dict[str, str]):
        self.started = {k: v for k, v in started.items() if not self.unread(k)}
        self.added = {k: v for k, v in imported.items() if k not in started}

    @classmethod
    def unread(cls, name: str) -> bool:
        """Whether the variable ``name`` is read by nothing at import (:data:`UNREAD`, :data:`OWN`)."""
        return name in cls.UNREAD or name.startswith(cls.OWN)

    def serves(self, env: dict[str, str]) -> bool:
        """Whether a fresh interpreter started with ``env`` would import as the server did: ``env`` is the one the
        server started with (but the variables nothing reads at import, :meth:`unread`), plus any of the
        variables its imports set, at their values."""
        env = {k: v for k, v in env.items() if not self.unread(k)}
        extra = {k: v for k, v in env.items() if k not in self.started}
        return all(env.get(k) == v for k, v in self.started.items()) and all(
            self.added.get(k) == v for k, v in extra.items())


def sources(root: Path | None = None) -> dict[str, tuple[int, int]]:
    """``(mtime_ns, size)`` of every Python file of the ``hybridtrain`` package (``root``): what the server
    imported, or will import lazily when a run needs it."""
    root = root or Path(__file__).resolve().parent
    out = {}
    for folder, _, files in os.walk(root):
        for name in files:
            if name.endswith(".py"):
                st = os.stat(os.path.join(folder, name))
                out[os.path.join(folder, name)] = (st.st_mtime_ns, st.st_size)
    return out


def serve(path: Path) -> NoReturn:
    """Import (:func:`warm`), then serve requests on the UNIX socket ``path`` (until killed: :class:`Server`)."""
    started = dict(os.environ)
    imported = sources()  # before the imports: a file edited while they run counts as changed
    warm()
    own = Environment(started, dict(os.environ))
    listener = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
    listener.bind(str(path))
    listener.listen(16)
    signal.signal(signal.SIGCHLD, signal.SIG_IGN)  # watchers are reaped by the kernel
    sys.stdout.write("ready\n")
    sys.stdout.flush()
    devnull = os.open(os.devnull, os.O_RDWR)  # the starter reads no more: its pipe is not held by the runs
    os.dup2(devnull, 1)
    os.close(devnull)
    gc.freeze()  # the forks then leave the pages they share with this process alone
    while True:
        conn, _ = listener.accept()
        if os.fork() == 0:
            listener.close()
            _watch(conn, own, imported)
        conn.close()


def _recv_exact(conn: socket.socket, n: int) -> bytes:
    data = b""
    while len(data) < n:
        chunk = conn.recv(n - len(data))
        if not chunk:
            raise ConnectionError("the requester went away")
        data += chunk
    return data


def _watch(conn: socket.socket, own: Environment, imported: dict[str, tuple[int, int]]) -> NoReturn:
    """In a watcher: read the request, fork the run, report its pid and exit code. Refused when the request's
    environment is not the server's, or when hybridtrain's sources changed since the server imported them (a
    fork would run the old code of what it imported and the new code of what it imports later)."""
    code = 1
    try:
        signal.signal(signal.SIGCHLD, signal.SIG_DFL)
        _, fds, _, _ = socket.recv_fds(conn, 1, 3)
        (size,) = HEADER.unpack(_recv_exact(conn, HEADER.size))
        job = json.loads(_recv_exact(conn, size))
        if not own.serves(job["env"]) or len(fds) != 3 or sources() != imported:
            conn.sendall(b"refused\n")
            os._exit(0)
        pid = os.fork()
        if pid == 0:
            conn.close()
            _run(job, {**own.added, **job["env"]}, fds)
        for fd in fds:
            os.close(fd)
        conn.sendall(f"pid {pid}\n".encode())
        code = _wait(pid, conn)
        conn.sendall(f"exit {code}\n".encode())
    except (ConnectionError, BrokenPipeError, OSError):
        pass
    os._exit(0 if code is not None else 1)


def _wait(pid: int, conn: socket.socket) -> int | None:
    """The run's exit code; ``None`` when the requester closed the connection first (the run is then killed)."""
    import select

    pidfd = os.pidfd_open(pid)
    while True:
        ready, _, _ = select.select([pidfd, conn], [], [])
        if pidfd in ready:
            _, status = os.waitpid(pid, 0)
            return os.waitstatus_to_exitcode(status)
        if not conn.recv(1):  # the requester is gone: so is the run
            os.kill(pid, signal.SIGKILL)
            os.waitpid(pid, 0)
            return None


def _run(job: dict, env: dict[str, str], fds: list[int]) -> NoReturn:
    """In the run: take the requester's environment ``env``, descriptors, folder and umask, then run
    ``hybridtrain`` as ``-m`` would."""
    import runpy

    code = 1
    try:
        for target, fd in enumerate(fds):
            os.dup2(fd, target)
            os.close(fd)
        signal.signal(signal.SIGINT, signal.default_int_handler)
        os.environ.clear()  # exactly the requester's (what differs is unread at import: Environment.UNREAD)
        os.environ.update(env)
        os.chdir(job["cwd"])
        os.umask(job["umask"])
        sys.argv = ["-m", *job["args"]]
        sys.modules.pop("hybridtrain.__main__", None)  # run as -m runs it: the module as __main__, not imported
        runpy.run_module("hybridtrain", run_name="__main__", alter_sys=True)
        code = 0
    except SystemExit as stop:
        code = stop.code if isinstance(stop.code, int) else (0 if stop.code is None else 1)
    except BaseException:  # noqa: BLE001 - what an interpreter prints for an uncaught exception
        import traceback

        traceback.print_exc()
    sys.stdout.flush()
    sys.stderr.flush()
    os._exit(code)


def request(path: Path | str, args: Sequence[str], env: dict[str, str], cwd: Path | str | None,
            stdio: Sequence[int]) -> tuple[socket.socket, int] | None:
    """Ask the server at ``path`` to start ``python -m hybridtrain ARGS`` with ``env`` in ``cwd``, its stdin,
    stdout and stderr the descriptors ``stdio``. The connection, whose next line says ``exit CODE``
    (:func:`read_line`; closing it kills the run), and the run's pid; ``None`` when the server refused it
    (another environment) or is not there."""
    umask = os.umask(0)
    os.umask(umask)
    body = json.dumps({"args": list(args), "env": env, "cwd": str(cwd or os.getcwd()), "umask": umask}).encode()
    conn = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
    try:
        conn.connect(str(path))
        socket.send_fds(conn, [b"\0"], list(stdio))
        conn.sendall(HEADER.pack(len(body)) + body)
        first = read_line(conn)
    except OSError:
        conn.close()
        return None
    if not first.startswith("pid "):
        conn.close()
        return None
    return conn, int(first.split()[1])


class Started:
    """A run the server forked for :func:`start`, with what :class:`subprocess.Popen` offers of it here: its
    ``pid``, :meth:`poll`, :meth:`wait`, :meth:`kill` and ``returncode`` (as ``Popen`` gives it)."""

    def __init__(self, args: Sequence[str], conn: socket.socket, pid: int):
        self.args, self.pid, self._conn = list(args), pid, conn
        self.returncode: int | None = None

    def wait(self, timeout: float | None = None) -> int:
        """The exit code, once the run ends; :class:`subprocess.TimeoutExpired` after ``timeout`` seconds."""
        import select
        import subprocess

        if self.returncode is None:
            if not select.select([self._conn], [], [], timeout)[0]:
                raise subprocess.TimeoutExpired(self.args, timeout)
            line = read_line(self._conn)
            self._conn.close()
            self.returncode = int(line.split()[1]) if line.startswith("exit ") else -signal.SIGKILL
        return self.returncode

    def poll(self) -> int | None:
        """The exit code, or ``None`` while the run goes on."""
        import subprocess

        try:
            return self.wait(0)
        except subprocess.TimeoutExpired:
            return None

    def kill(self) -> None:
        """SIGKILL the run (its watcher reports the exit; its ranks die with it), unless it has ended."""
        if self.poll() is None:
            try:
                os.kill(self.pid, signal.SIGKILL)
            except ProcessLookupError:  # ended since: the watcher's line says so
                pass


def start(path: Path | str, args: Sequence[str], env: dict[str, str], cwd: Path | str | None,
          stdout: int, stderr: int) -> Started | None:
    """``python -m hybridtrain ARGS`` (``args`` the whole command line, :func:`hybridtrain.cli.command`) started
    by the server at ``path``, its stdin ``/dev/null``, its stdout and stderr the descriptors given, not waited
    for; ``None`` when the server refused it or is not there."""
    stdin = os.open(os.devnull, os.O_RDONLY)
    try:
        started = request(path, args[3:], env, cwd, [stdin, stdout, stderr])  # after "python -m hybridtrain"
    finally:
        os.close(stdin)
    return None if started is None else Started(args, *started)


def run(path: Path | str, args: Sequence[str], env: dict[str, str], cwd: Path | str | None,
        timeout: float | None):
    """``python -m hybridtrain ARGS`` (``args`` the whole command line, :func:`hybridtrain.cli.command`) started
    by the server at ``path`` and run to the end: a :class:`subprocess.CompletedProcess` with its output as text,
    as :func:`subprocess.run` gives it (``capture_output=True, text=True``); ``None`` when the server refused
    it or is not there. Past ``timeout`` seconds the run is killed and :class:`subprocess.TimeoutExpired`
    raised."""
    import selectors
    import subprocess
    import time

    out_r, out_w = os.pipe()
    err_r, err_w = os.pipe()
    try:
        started = start(path, args, env, cwd, out_w, err_w)
    finally:
        for fd in (out_w, err_w):
            os.close(fd)
    if started is None:
        os.close(out_r)
        os.close(err_r)
        return None
    chunks: dict[int, list[bytes]] = {out_r: [], err_r: []}
    deadline = None if timeout is None else time.monotonic() + timeout
    killed = False
    with selectors.DefaultSelector() as sel:
        for fd in chunks:
            sel.register(fd, selectors.EVENT_READ)
        while sel.get_map():
            wait = None if deadline is None or killed else max(0.0, deadline - time.monotonic())
            events = sel.select(wait)
            if not events and not killed:  # past the deadline: kill it, then read what it wrote
                started.kill()
                killed = True
            for key, _ in events:
                data = os.read(key.fd, 65536)
                if data:
                    chunks[key.fd].append(data)
                else:
                    sel.unregister(key.fd)
                    os.close(key.fd)
    code = started.wait()
    out, err = (_text(b"".join(chunks[fd])) for fd in (out_r, err_r))
    if killed:
        raise subprocess.TimeoutExpired(list(args), timeout, output=out, stderr=err)
    return subprocess.CompletedProcess(list(args), code, out, err)


def _text(data: bytes) -> str:
    """Output as :func:`subprocess.run` with ``text=True`` decodes it (the locale's encoding, universal newlines)."""
    import locale

    return data.decode(locale.getpreferredencoding(False)).replace("\r\n", "\n").replace("\r", "\n")


def read_line(conn: socket.socket) -> str:
    """One line the watcher wrote (``""`` when it closed the connection)."""
    out = b""
    while not out.endswith(b"\n"):
        chunk = conn.recv(1)
        if not chunk:
            break
        out += chunk
    return out.decode().strip()


if __name__ == "__main__":
    serve(Path(sys.argv[1]))
