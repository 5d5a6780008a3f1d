"""Warm starts (:mod:`hybridtrain.warmstart`), which fork most of the suite's runs: a warm run is the run a fresh
``python -m hybridtrain`` makes (the same output lines, losses, files and exit codes), a run in another
environment is refused and starts fresh, and a run whose requester goes away or times out is killed with its
preload process and ranks."""
from __future__ import annotations

import os
import subprocess
import time

import psutil
import pytest

from hybridtrain import cli
from hybridtrain.rundir import RunDir
from hybridtrain.warmstart import Server, request

from helpers.launch import NO_REPORT, REPO

RUN = ["+recipe=gpt_tiny", "parallel.dp=2", "trainer.max_steps=3", NO_REPORT]


@pytest.fixture(scope="module")
def server(tmp_path_factory, monkeypatch_module):
    folder = tmp_path_factory.mktemp("own_warm")
    monkeypatch_module.setenv(cli.WARM_START, str(folder / "warm.sock"))
    started = Server(folder, cli.environment(None))
    yield started
    started.close()


@pytest.fixture(scope="module")
def monkeypatch_module():
    with pytest.MonkeyPatch.context() as patch:
        yield patch


def _lines(text: str) -> list[str]:
    """hybridtrain's own lines, less those that hold timings or process ids."""
    timed = ("ready in", "saved ", "MFU peak", "launching")
    return [line for line in text.splitlines() if line.startswith("[hybridtrain]") and not any(t in line for t in timed)]


def test_a_warm_run_is_the_fresh_interpreters_run(server, tmp_path):
    warm = cli.run(tmp_path / "warm", RUN, timeout=300, cwd=REPO, check=True)
    fresh = cli.run(tmp_path / "fresh", RUN, timeout=300, cwd=REPO, check=True, env={"WARM_START_TEST_FRESH": "1"})
    assert _lines(warm.stdout) == _lines(fresh.stdout) and len(_lines(warm.stdout)) >= 6
    assert "Traceback" not in warm.stderr and "RuntimeWarning" not in warm.stderr, warm.stderr[-2000:]
    assert RunDir(tmp_path / "warm").losses() == RunDir(tmp_path / "fresh").losses()
    assert sorted(p.name for p in (tmp_path / "warm").iterdir()) == sorted(p.name for p in (tmp_path / "fresh").iterdir())
    bad = cli.run(tmp_path / "bad", ["+recipe=gpt_tiny", "parallel.tp=abc"], timeout=120, cwd=REPO)
    assert bad.returncode == 2 and bad.stderr.strip().splitlines() == [
        "[hybridtrain] config error: parallel.tp: 'abc' is not an integer"], bad.stderr


def test_the_servers_environment_is_served_and_another_refused(server):
    """Served: the environment the server started with, plus what importing torch adds; refused: one more variable."""
    from hybridtrain.warmstart import read_line

    import torch  # noqa: F401  (sets TORCHINDUCTOR_CACHE_DIR here, as it did in the server: still served)

    devnull = os.open(os.devnull, os.O_RDWR)
    try:
        served = request(server.path, ["--help"], cli.environment(None), REPO, [devnull, devnull, devnull])
        refused = request(server.path, ["--help"], {**server.env, "WARM_START_TEST_FRESH": "1"}, REPO,
                          [devnull, devnull, devnull])
    finally:
        os.close(devnull)
    assert served is not None and read_line(served[0]) == "exit 0"
    served[0].close()
    assert refused is None


def test_an_edit_of_hybridtrain_after_the_server_imported_it_is_refused(tmp_path, monkeypatch):
    """A server that imported a copy of the package refuses every request once a file of that copy changed: a
    fork would run the old code of what the server imported and the new code of what the run imports later."""
    import shutil

    from hybridtrain.warmstart import read_line, sources

    copy = tmp_path / "src"
    shutil.copytree(REPO / "hybridtrain", copy / "hybridtrain", ignore=shutil.ignore_patterns("__pycache__"))
    assert sources(copy / "hybridtrain") and sources(copy / "hybridtrain") == sources(copy / "hybridtrain")
    monkeypatch.chdir(tmp_path)  # python -m puts its working folder first on the path: the copy's parent, not REPO
    own = Server(tmp_path, cli.environment(None, path_first=[copy]))
    devnull = os.open(os.devnull, os.O_RDWR)
    try:
        served = request(own.path, ["--help"], own.env, REPO, [devnull, devnull, devnull])
        assert served is not None and read_line(served[0]) == "exit 0"
        served[0].close()
        lazily = copy / "hybridtrain" / "objectives" / "reward.py"  # a module a run imports when it needs it
        lazily.write_text(lazily.read_text() + "\n# edited\n")
        assert request(own.path, ["--help"], own.env, REPO, [devnull, devnull, devnull]) is None
    finally:
        os.close(devnull)
        own.close()


def _tree(pid: int) -> list[psutil.Process]:
    return [psutil.Process(pid), *psutil.Process(pid).children(recursive=True)]


def test_a_run_dies_with_its_requester_and_at_its_timeout(server, tmp_path):
    out = tmp_path / "out.txt"
    with open(out, "w") as log, open(os.devnull) as devnull:
        conn, pid = request(server.path, [*cli.command(tmp_path / "run", ["+recipe=gpt_tiny", "trainer.max_steps=100000",
                                                                         NO_REPORT])[3:]],
                            server.env, REPO, [devnull.fileno(), log.fileno(), log.fileno()])
    deadline = time.monotonic() + 120
    while "train:" not in out.read_text() and time.monotonic() < deadline:  # the ranks are training
        time.sleep(0.5)
    tree = _tree(pid)
    assert len(tree) >= 3, out.read_text()[-2000:]  # the controller, its preload process, the rank
    conn.close()
    gone, alive = psutil.wait_procs(tree, timeout=30)
    assert not alive, alive
    start = time.monotonic()
    with pytest.raises(subprocess.TimeoutExpired):
        cli.run(tmp_path / "slow", ["+recipe=gpt_tiny", "trainer.max_steps=100000", NO_REPORT], timeout=8, cwd=REPO)
    assert time.monotonic() - start < 60
    deadline = time.monotonic() + 30  # the watcher, the run, its preload process and rank: all gone
    while psutil.Process(server.pid).children(recursive=True) and time.monotonic() < deadline:
        time.sleep(0.5)
    assert not psutil.Process(server.pid).children(recursive=True)
