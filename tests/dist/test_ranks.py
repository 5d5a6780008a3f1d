"""The local launcher's rank supervision (``hybridtrain.launch.ranks``) with tiny Python processes:
a failing rank ends the others, signals reach every rank, a clean finish returns 0; the process that
forks the CPU ranks failing before it starts them, and how a forked rank is recognised."""
from __future__ import annotations

import os
import signal
import subprocess
import sys
import threading
import time

import psutil

from hybridtrain.launch.ranks import Ranks, rank_env

SLEEPER = "import time\ntime.sleep(60)\n"


def _start(scripts: list[str], tmp_path) -> Ranks:
    ranks = Ranks()
    envs = [rank_env(os.environ, r, len(scripts), 29999, range(len(scripts))) for r in range(len(scripts))]
    for env, script in zip(envs, scripts):
        path = tmp_path / f"rank{env['RANK']}.py"
        path.write_text(script)
        ranks.start([sys.executable, str(path)], [env])
    return ranks


def test_a_failing_rank_ends_the_others_and_its_code_is_the_jobs(tmp_path):
    child = "import subprocess, sys, time\nsubprocess.Popen([sys.executable, '-c', 'import time; time.sleep(60)'])\ntime.sleep(60)\n"
    ranks = _start([child, "import sys, time\ntime.sleep(0.5)\nsys.exit(3)\n"], tmp_path)
    time.sleep(0.3)
    tree = [q for p in ranks.procs for q in psutil.Process(p.pid).children(recursive=True)]
    t0 = time.monotonic()
    assert ranks.wait() == 3
    assert time.monotonic() - t0 < 10
    assert all(p.poll() is not None for p in ranks.procs)
    assert tree and not any(q.is_running() and q.status() != psutil.STATUS_ZOMBIE for q in tree), "a rank's child left behind"


def test_a_rank_killed_by_a_signal_reports_128_plus_the_signal(tmp_path):
    ranks = _start([SLEEPER, "import os, signal\nos.kill(os.getpid(), signal.SIGKILL)\n"], tmp_path)
    assert ranks.wait() == 128 + signal.SIGKILL


def test_sigterm_reaches_every_rank_which_exits_in_its_own_time(tmp_path):
    """Like a rank that checkpoints on SIGTERM: each catches it, works 2 s more, exits 0."""
    graceful = ("import signal, sys, time\nstop = []\nsignal.signal(signal.SIGTERM, lambda *a: stop.append(1))\n"
                "while not stop:\n    time.sleep(0.05)\ntime.sleep(2)\nsys.exit(0)\n")
    ranks = _start([graceful, graceful], tmp_path)
    time.sleep(1.0)  # both have installed their handler
    threading.Timer(0.2, ranks.forward, args=(signal.SIGTERM,)).start()
    assert ranks.wait() == 0


def test_sigint_ends_every_rank(tmp_path):
    """Also when this process runs with SIGINT ignored, as a background job of a shell does."""
    old = signal.signal(signal.SIGINT, signal.SIG_IGN)  # the ranks would inherit it
    try:
        ranks = _start([SLEEPER, SLEEPER], tmp_path)
    finally:
        signal.signal(signal.SIGINT, old)
    time.sleep(0.5)
    ranks.forward(signal.SIGINT)
    assert ranks.wait() != 0 and all(p.poll() is not None for p in ranks.procs)


def test_every_rank_exiting_cleanly_is_a_clean_job(tmp_path):
    assert _start(["pass\n", "import time\ntime.sleep(0.3)\n"], tmp_path).wait() == 0


def _controller(script: str) -> subprocess.CompletedProcess:
    """``script`` in a new interpreter, like the controller, which forks the preload process first."""
    head = ("import os, sys\nfrom hybridtrain.launch.preload import fork_preloader\n"
            "from hybridtrain.launch.ranks import Ranks, rank_env\npreloader = fork_preloader()\n")
    return subprocess.run([sys.executable, "-c", head + script], capture_output=True, text=True, timeout=120)


def test_forked_ranks_that_cannot_start_end_the_job_with_the_preload_process_code(tmp_path):
    """The process that forks the CPU ranks fails before forking (here: no ``config.yaml`` to read):
    the job ends with its code, a line saying so, and no rank left behind."""
    done = _controller("envs = [rank_env(os.environ, r, 2, 29999, range(2)) for r in range(2)]\n"
                       f"ranks = Ranks()\nranks.fork({str(tmp_path)!r}, os.environ, envs, None, preloader)\n"
                       "print('ranks', len(ranks.procs), 'code', ranks.wait())\n")
    assert "ranks 0 code 1" in done.stdout, done.stderr
    assert "config.yaml" in done.stderr and "exited with code 1 before starting them all" in done.stderr


def test_the_preload_process_of_a_run_that_never_launches_exits_with_it():
    """A config error or a dry run ends the controller before the launch: the process it forked to
    start the ranks sees its socket close and exits too."""
    done = _controller("print(preloader.pid, flush=True)\nsys.exit(2)\n")
    assert done.returncode == 2, done.stderr
    pid = int(done.stdout.split()[0])
    deadline = time.monotonic() + 20
    while time.monotonic() < deadline:
        try:
            if psutil.Process(pid).status() == psutil.STATUS_ZOMBIE:
                break
        except psutil.NoSuchProcess:
            break
        time.sleep(0.05)
    else:
        raise AssertionError(f"the preload process {pid} outlived its controller")


def test_a_forked_rank_is_found_by_its_name(tmp_path):
    """A forked rank keeps its parent's command line and start-up environment; tools find it by the
    name it gives itself (``/proc/PID/comm``), a rank started as its own interpreter by ``RANK``."""
    from hybridtrain.launch.ranks import rank_of

    named = subprocess.Popen([sys.executable, "-c", "from hybridtrain.launch.preload import _name, rank_name\n"
                              "_name(rank_name(12))\nimport time\ntime.sleep(30)"])
    # a command line naming the worker (what rank_of reads; the real worker would exit on this empty folder)
    own = subprocess.Popen([sys.executable, "-c", "import time; time.sleep(30)", "hybridtrain.worker", str(tmp_path)],
                           env={**os.environ, "RANK": "5"})
    try:
        deadline = time.monotonic() + 20
        while psutil.Process(named.pid).name() != "hybridtrain-r12" and time.monotonic() < deadline:
            time.sleep(0.05)
        assert rank_of(psutil.Process(named.pid)) == 12
        assert rank_of(psutil.Process(own.pid)) == 5
        assert rank_of(psutil.Process()) is None  # pytest: no rank
    finally:
        named.kill()
        own.kill()
        named.wait()
        own.wait()
