"""Faults: a rank killed mid-step, a hung rank, an output directory that cannot be written, a full disk.

Faults are injected from outside the production code by ``tests/fault_inject/sitecustomize.py``
(put first on the workers' ``PYTHONPATH``), which wraps DeepSpeed's pipeline engine in the rank
named by ``HT_FAULT_RANK``.
"""
from __future__ import annotations

import os
import shlex
import shutil
import subprocess
import sys
import time
from pathlib import Path

import pytest

from hybridtrain import cli
from hybridtrain.rundir import RunDir
from helpers.config import compose
from helpers.launch import REPO, metrics, run_cli

INJECT = Path(__file__).resolve().parents[1] / "fault_inject"  # tests/fault_inject
MICRO = 12  # gpt_tiny: global batch 12 = micro 1 x 12 micro-batches at dp=1


def _fault_env(kind: str, rank: int, at: int, **extra: str) -> dict:
    path = os.pathsep.join(p for p in (str(INJECT), str(REPO), os.environ.get("PYTHONPATH", "")) if p)
    return {"PYTHONPATH": path, "HT_FAULT": kind, "HT_FAULT_RANK": str(rank), "HT_FAULT_AT": str(at), **extra}


def _left_behind(run_dir: Path) -> list[str]:
    """Processes (runner, launcher, workers) whose command line names ``run_dir``."""
    out = subprocess.run(["pgrep", "-af", str(run_dir)], capture_output=True, text=True)
    return [ln for ln in out.stdout.splitlines() if "pgrep" not in ln]


def test_rank_killed_mid_step_ends_job_and_resume_gives_the_uninterrupted_losses(tmp_path):
    """4 ranks (tp=2 x pp=2); rank 1 SIGKILLs itself in step 6 after 6 of its 12 backward passes.
    Checkpoints step_2 and step_4 are complete; resuming picks step_4 and continues the losses."""
    run_dir, stamp = tmp_path / "run", tmp_path / "killed_at"
    common = ["+recipe=gpt_tiny", "parallel.tp=2", "parallel.pp=2", "trainer.max_steps=6", "trainer.save_every=2"]
    proc = run_cli(run_dir, *common, "launcher.timeout_minutes=5", check=False, timeout=300,
                   env=_fault_env("kill", rank=1, at=5 * MICRO + MICRO // 2, HT_FAULT_STAMP=str(stamp)))
    ended = time.time()
    assert proc.returncode != 0, proc.stdout[-3000:]
    assert stamp.exists(), f"the injected kill never ran\n{proc.stdout[-3000:]}\n{proc.stderr[-3000:]}"
    assert ended - float(stamp.read_text()) < 60, "the job took over 60 s to end after the kill"
    assert "training failed" in proc.stderr and str(run_dir) in proc.stderr
    time.sleep(1)
    assert _left_behind(run_dir) == [], "processes left behind"
    before = metrics(run_dir)
    assert [m["step"] for m in before] == [1, 2, 3, 4, 5], "the kill was not in step 6"
    ckpts = RunDir(run_dir).checkpoints
    assert (ckpts / "step_4" / "meta.json").exists() and not (ckpts / "step_6").exists()

    resumed = run_cli(run_dir, *common, "trainer.resume=auto", timeout=300)
    assert f"resumed from {ckpts / 'step_4'} at step 4 (same plan)" in resumed.stdout
    # metrics.jsonl is appended to and marks the resume; the reader returns one history, in which
    # the resumed run's step 5 replaces the one the killed run logged after its last checkpoint
    records = RunDir(run_dir).metric_records()
    assert records[5] == {"event": "resume", "step": 4, "checkpoint": str(ckpts / "step_4")}
    assert [r["step"] for r in records] == [1, 2, 3, 4, 5, 4, 5, 6]
    history = metrics(run_dir)
    assert [m["step"] for m in history] == [1, 2, 3, 4, 5, 6] and history[4] == records[6]
    # Step 5 ran before the kill: the resumed run repeats it exactly (same plan: bit-exact state).
    assert history[4]["loss"] == pytest.approx(before[4]["loss"], rel=1e-6, abs=0)
    # The whole killed + resumed history is the uninterrupted run: plain transformers, 6 steps.
    from hybridtrain.reference import reference_run

    ref = [r["loss"] for r in reference_run(compose("+recipe=gpt_tiny", "trainer.max_steps=6"))]
    assert [m["loss"] for m in history] == pytest.approx(ref, rel=1e-4, abs=0)


@pytest.mark.slow  # CI keeps the watchdog firing with its stack and exit code, and staying quiet (below)
def test_hang_watchdog_dumps_every_rank_and_ends_the_job(tmp_path):
    """2 ranks (pp=2); rank 1 sleeps forever in step 3. ``trainer.hang_timeout_s=10``: both ranks
    print their stacks (rank 1's shows the injected stall) and the job exits non-zero."""
    run_dir = tmp_path / "run"
    t0 = time.monotonic()
    proc = run_cli(run_dir, "+recipe=gpt_tiny", "parallel.pp=2", "trainer.max_steps=50", "trainer.hang_timeout_s=10",
                   "trainer.save_final=false", "launcher.timeout_minutes=5", check=False, timeout=240,
                   env=_fault_env("stall", rank=1, at=2 * MICRO + 3))
    elapsed = time.monotonic() - t0
    out = proc.stdout + proc.stderr
    assert proc.returncode != 0, out[-3000:]
    for rank in (0, 1):
        assert (f"rank {rank}: no training step finished for" in proc.stderr
                and "(trainer.hang_timeout_s=10)" in proc.stderr), f"rank {rank} printed no stack\n{out[-4000:]}"
    assert proc.stderr.count("most recent call first") >= 2, out[-4000:]  # faulthandler's thread headers
    assert "_ht_injected_stall" in proc.stderr, "the stalled frame is not in the dump"
    assert "training failed" in proc.stderr
    assert [m["step"] for m in metrics(run_dir)] == [1, 2]
    assert elapsed < 200, f"{elapsed:.0f}s: the watchdog did not end the job promptly"
    time.sleep(1)
    assert _left_behind(run_dir) == [], "processes left behind"


def _watchdog_script(timeout: float, body: str) -> subprocess.CompletedProcess:
    code = ("import time\nfrom hybridtrain.train.watchdog import Watchdog\n"
            f"w = Watchdog({timeout}, rank=0).start()\n{body}\nw.stop()\nprint('finished')\n")
    return subprocess.run([sys.executable, "-c", code], cwd=REPO, capture_output=True, text=True, timeout=60,
                          env=dict(os.environ, PYTHONPATH=str(REPO)))


def test_watchdog_fires_on_a_stall_with_the_stack_and_exit_code():
    from hybridtrain.train.watchdog import HANG_EXIT_CODE

    proc = _watchdog_script(1, "def stalled_here():\n    time.sleep(60)\nstalled_here()")
    assert proc.returncode == HANG_EXIT_CODE, proc.stderr
    assert "rank 0: no training step finished for" in proc.stderr and "hang_timeout_s=1" in proc.stderr
    assert "stalled_here" in proc.stderr and "finished" not in proc.stdout


def test_watchdog_stays_quiet_while_steps_beat_and_when_off():
    beating = _watchdog_script(1, "for _ in range(12):\n    time.sleep(0.25)\n    w.beat()")
    assert beating.returncode == 0 and "finished" in beating.stdout, beating.stderr
    off = _watchdog_script(None, "time.sleep(1.5)")
    assert off.returncode == 0 and "finished" in off.stdout, off.stderr


@pytest.mark.parametrize("where", ["under_a_file", "a_file", "proc"])
def test_unwritable_output_dir_is_a_config_error_before_anything_runs(where, tmp_path):
    """Tests run as root, so permission bits would not stop a write: a path under a regular file, a
    regular file itself and one under /proc cannot be created by anyone."""
    blocker = tmp_path / "a_file"
    blocker.write_text("not a folder")
    run_dir = {"under_a_file": blocker / "run", "a_file": blocker,
               "proc": Path(f"/proc/hybridtrain-test-{os.getpid()}/run")}[where]
    proc = run_cli(run_dir, "+recipe=gpt_tiny", "trainer.max_steps=1", check=False, timeout=120)
    assert proc.returncode == 2, proc.stderr[-3000:]
    assert "[hybridtrain] config error: hydra.run.dir: cannot write the output directory" in proc.stderr
    assert str(run_dir) in proc.stderr and "Traceback" not in proc.stderr
    assert "[hybridtrain]" not in proc.stdout  # stopped before the plan summary, data and workers


@pytest.mark.parametrize("what", ["a_file", "a_dangling_link", "read_only_mount"])
def test_an_unwritable_checkpoint_folder_is_a_config_error_before_anything_runs(what, tmp_path):
    """Fault probe n63, n64: ``RUN_DIR/checkpoints`` a regular file (with ``trainer.resume=auto``, which said
    "starting fresh"), a link to nothing, or a read-only mount: the run trained every step and lost them at the
    first save. Now exit 2 naming the folder before the plan, the data or a rank; ``trainer.save_final=false``
    with no ``save_every`` saves nothing and runs. The mount needs root or user namespaces (``unshare -m``)."""
    run_dir = tmp_path / "run"
    ckpts = RunDir(run_dir).checkpoints
    run_dir.mkdir()
    common = ["+recipe=gpt_tiny", "trainer.max_steps=2", "trainer.resume=auto"]
    if what == "read_only_mount":
        if not _can_mount_tmpfs():
            pytest.skip("a read-only bind mount needs root or user namespaces (unshare -m)")
        ckpts.mkdir()
        script = (f"mount --bind {ckpts} {ckpts} && mount -o remount,bind,ro {ckpts} || exit 97\n"
                  f"{shlex.join(cli.command(run_dir, common))}\n")
        proc = subprocess.run(["unshare", "-m", "sh", "-c", script], cwd=REPO, env=cli.environment(None),
                              capture_output=True, text=True, timeout=120)
        why = "not writable: OSError: Read-only file system"
    else:
        if what == "a_file":
            ckpts.write_text("not a folder")
            why = "a file, not a folder"
        else:
            ckpts.symlink_to(tmp_path / "gone")
            why = f"a link to {tmp_path / 'gone'}, which does not exist"
        proc = run_cli(run_dir, *common, check=False, timeout=120)
    assert proc.returncode == 2, proc.stderr[-3000:]
    assert (f"[hybridtrain] config error: hydra.run.dir: the run's checkpoint folder {ckpts} is {why}, so its saves "
            "would fail after the training") in proc.stderr, proc.stderr[-3000:]
    assert "Traceback" not in proc.stderr and "[hybridtrain]" not in proc.stdout
    if what == "a_file":
        ok = run_cli(run_dir, "+recipe=gpt_tiny", "trainer.max_steps=2", "trainer.save_final=false",
                     "launcher.dry_run=true", timeout=120)
        assert ok.returncode == 0


def test_an_empty_run_dir_is_a_config_error_and_writes_nothing(tmp_path):
    """``hydra.run.dir=`` made Hydra put the whole run into the current folder (the repository root):
    run from an empty folder, it is refused there, which stays empty (a dry run would write config.yaml)."""
    work = tmp_path / "cwd"
    work.mkdir()
    proc = cli.run(None, ["+recipe=gpt_tiny", "launcher.dry_run=true", "hydra.run.dir="], cwd=work, timeout=120)
    assert proc.returncode == 2, proc.stdout[-3000:] + proc.stderr[-3000:]
    assert (f"[hybridtrain] config error: hydra.run.dir: an empty value would write the run into the current folder "
            f"{work}; give a folder, e.g. hydra.run.dir=runs/my_run") in proc.stderr
    assert "Traceback" not in proc.stderr and "[hybridtrain]" not in proc.stdout
    assert list(work.iterdir()) == []


def test_unwritable_sweep_dir_is_a_config_error(tmp_path):
    blocker = tmp_path / "a_file"
    blocker.write_text("")
    proc = cli.run(None, ["-m", "+recipe=gpt_tiny", "parallel.tp=1,2", "launcher.dry_run=true",
                          f"hydra.sweep.dir={blocker / 'sweep'}"], cwd=REPO, timeout=120)
    assert proc.returncode == 2, proc.stderr[-3000:]
    assert f"hydra.sweep.dir: cannot write the output directory {blocker / 'sweep'} ({blocker} is a file" in proc.stderr


def _can_mount_tmpfs() -> bool:
    """Whether this process may mount a tmpfs in a private mount namespace (root, or a user namespace)."""
    if shutil.which("unshare") is None:
        return False
    probe = subprocess.run(["unshare", "-m", "sh", "-c", "mount -t tmpfs -o size=1m tmpfs /mnt"],
                           capture_output=True, timeout=30)
    return probe.returncode == 0


@pytest.mark.skipif(not _can_mount_tmpfs(), reason="mounting a small tmpfs needs root or user namespaces "
                    "(unshare -m); the check itself is tested in tests/unit/test_checkpoint_files.py")
def test_full_disk_during_a_save_names_the_device_and_leaves_no_partial_folder(tmp_path):
    """RUN_DIR/checkpoints is a 100 MB tmpfs (in a private mount namespace, gone with the job), a
    gpt_tiny checkpoint about 30 MB. Run 1 saves step_1; while it saves step_2 the disk fills up
    (tests/fault_inject: another writer takes every free byte), so DeepSpeed's write meets a real
    ENOSPC: the rank says "no space left on" the mount, exits 1, and .tmp-step_2 (with the filler
    in it) is gone, the space free again. Then the tmpfs shrinks to 40 MB and run 2 resumes from
    step_1: the free space is checked before step_2 is written, and the save is refused, nothing written."""
    run_dir = tmp_path / "run"
    ckpts = RunDir(run_dir).checkpoints
    ckpts.mkdir(parents=True)
    listing = tmp_path / "listing"
    common = ["+recipe=gpt_tiny", "trainer.max_steps=3", "trainer.save_every=1", "trainer.report=false"]
    first = shlex.join(cli.command(run_dir, common))
    second = shlex.join(cli.command(run_dir, [*common, "trainer.resume=auto"]))
    ls, used = f"$(ls -A {ckpts} | tr '\\n' ' ')", f"$(df -k --output=used {ckpts} | tail -1)"
    script = (f"mount -t tmpfs -o size=100m tmpfs {ckpts} || exit 97\n"
              f"HT_FAULT=fill {first}; echo \"first: $?\" >> {listing}\n"
              f"echo \"ls1: {ls}\" >> {listing}; echo \"used1: {used}\" >> {listing}\n"
              f"mount -o remount,size=40m {ckpts} || exit 98\n"
              f"{second}; echo \"second: $?\" >> {listing}; echo \"ls2: {ls}\" >> {listing}\n")
    env = cli.environment(_fault_env("fill", rank=0, at=2))
    env.pop("HT_FAULT")  # set in the script, for the first run only
    proc = subprocess.run(["unshare", "-m", "sh", "-c", script], cwd=REPO, env=env, capture_output=True, text=True,
                          timeout=400)
    assert proc.returncode == 0, (proc.returncode, proc.stdout[-3000:], proc.stderr[-3000:])
    seen = dict(line.split(": ", 1) for line in listing.read_text().splitlines())
    stderr = proc.stderr
    assert seen["first"] == "1", stderr[-3000:]
    assert (f"[hybridtrain] rank 0: saving {ckpts / 'step_2'} failed: no space left on {ckpts} (needs 0.0" in stderr
            and "the disk filled up during the save" in stderr), stderr[-3000:]
    assert seen["ls1"].split() == ["latest", "step_1"]  # no .tmp-step_2, no filler
    assert int(seen["used1"]) < 40_000  # KiB: only step_1 (about 30 MB) is left on the disk
    assert seen["second"] == "1", stderr[-3000:]
    assert f"[hybridtrain] rank 0: cannot save {ckpts / 'step_2'}: no space left on {ckpts} (needs 0.0" in stderr
    assert seen["ls2"].split() == ["latest", "step_1"]
    assert "Traceback" not in stderr and "unexpected pos" not in stderr


def _descendants(pid: int) -> list:
    import psutil

    try:
        return psutil.Process(pid).children(recursive=True)
    except psutil.Error:
        return []


def _alive(procs: list) -> list:
    """The processes of ``procs`` still running (a zombie nobody reaped has ended)."""
    import psutil

    out = []
    for p in procs:
        try:
            if p.status() != psutil.STATUS_ZOMBIE:
                out.append(p)
        except psutil.Error:
            pass
    return out


@pytest.mark.parametrize("preload", ["forked", "own_interpreter",
                                     # CI keeps the runner's ranks watching the controller (the stand-in test below)
                                     pytest.param("multinode", marks=pytest.mark.slow)])
def test_ranks_die_with_a_sigkilled_controller(preload, tmp_path):
    """A real 2-rank CPU job (pp=2); once both ranks run, the controller gets SIGKILL: every process it
    started (the preload process, the ranks) is gone within a few seconds, instead of training on headless.
    ``launcher.verbose=true``: the ranks write to the console file, not to the controller's pipe, whose
    closing would kill them only at their next line (SIGPIPE)."""
    import psutil

    from hybridtrain.launch.ranks import rank_of

    from hybridtrain.ports import free_port

    run_dir = tmp_path / "run"
    env = {"HYBRIDTRAIN_PRELOAD": "0"} if preload == "own_interpreter" else None
    # multinode: the deepspeed runner (no_ssh, one node) -> DeepSpeed's launcher -> the ranks
    runner = ["launcher=multinode", "launcher.nodes=1", "launcher.no_ssh=true", "launcher.node_rank=0",
              "launcher.master_addr=127.0.0.1", f"launcher.master_port={free_port()}"] if preload == "multinode" else []
    with open(tmp_path / "out.txt", "w") as out:
        proc = cli.start(run_dir, ["+recipe=gpt_tiny", "parallel.pp=2", "trainer.max_steps=500", *runner,
                                   "trainer.save_final=false", "trainer.report=false", "launcher.verbose=true"],
                         env=env, cwd=REPO, stdout=out, stderr=subprocess.STDOUT)
    started = []
    try:
        deadline = time.monotonic() + 240
        ranks: list = []
        while time.monotonic() < deadline and proc.poll() is None:
            started = _descendants(proc.pid)
            ranks = []
            for p in started:
                try:
                    if rank_of(p) is not None:
                        ranks.append(p)
                except psutil.Error:
                    pass
            if len(ranks) == 2:
                break
            time.sleep(0.2)
        assert len(ranks) == 2, f"the ranks never started\n{(tmp_path / 'out.txt').read_text()[-3000:]}"
        proc.kill()
        proc.wait()
        deadline = time.monotonic() + 10
        while _alive(started) and time.monotonic() < deadline:
            time.sleep(0.1)
        left = _alive(started)
        assert not left, f"still running 10 s after the controller's SIGKILL: {[p.pid for p in left]}"
    finally:
        proc.kill()
        for p in _alive(started):
            try:
                p.kill()
            except psutil.Error:
                pass


def _assert_rank_dies_with_its_controller(tmp_path, controller: str, rank: str, ready: str) -> None:
    """Run the stand-in ``controller`` (Python source), wait until its stand-in ``rank`` prints ``ready``, SIGKILL
    the controller and assert the rank is gone within 10 s."""
    import psutil

    out = tmp_path / "out.txt"
    with open(out, "w") as f:
        proc = subprocess.Popen([sys.executable, "-c", controller], cwd=REPO, stdout=f, stderr=subprocess.STDOUT,
                                env=dict(os.environ, PYTHONPATH=str(REPO)))
    tree = []
    try:
        deadline = time.monotonic() + 60
        while ready not in out.read_text() and time.monotonic() < deadline:
            time.sleep(0.1)
        assert ready in out.read_text(), out.read_text()
        tree = _descendants(proc.pid)
        ranks = [p for p in tree if p.cmdline()[-1] == rank]
        assert len(ranks) == 1, tree
        proc.kill()
        proc.wait()
        psutil.wait_procs(ranks, timeout=10)
        assert not _alive(ranks), "the rank outlived its controller"
    finally:
        proc.kill()
        for p in _alive(tree):
            p.kill()


def test_a_rank_on_another_host_dies_with_the_controller(tmp_path):
    """A rank of ``launcher=multinode`` on a host other than the controller's (the ssh path; the controller may
    run on a login node with no rank) holds the controller's lifeline (``hybridtrain.launch.parent.Lifeline``, a
    TCP connection the controller keeps open) and ends itself when the controller is SIGKILLed. The rank stand-in
    connects to it as a rank on another host does (``hold_lifeline``: the pidfd path needs the same host)."""
    rank = ("import os, sys, time\nfrom hybridtrain.launch.parent import LIFELINE_ENV, hold_lifeline\n"
            "assert hold_lifeline(os.environ[LIFELINE_ENV])\nprint('holding', flush=True)\ntime.sleep(120)\n")
    controller = ("import os, subprocess, sys, time\nfrom hybridtrain.launch.parent import Lifeline\n"
                  "lifeline = Lifeline(toward='127.0.0.1')\n"
                  f"subprocess.Popen([sys.executable, '-c', {rank!r}], env={{**os.environ, **lifeline.env()}},\n"
                  "                 start_new_session=True)\n"  # not a child's death signal: only the lifeline
                  "time.sleep(120)\n")
    _assert_rank_dies_with_its_controller(tmp_path, controller, rank, "holding")


def test_an_unreachable_lifeline_is_said_and_not_fatal(capsys):
    """A rank that cannot reach the controller's lifeline says so and trains on (it then ends at its next
    collective with the dead ranks, as before the lifeline existed)."""
    import socket

    from hybridtrain.launch.parent import hold_lifeline

    with socket.socket() as s:  # a port nobody listens on
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    assert hold_lifeline(f"127.0.0.1:{port}", timeout=2) is False
    assert "cannot reach the controller at 127.0.0.1:" in capsys.readouterr().out


def test_a_rank_the_runner_started_dies_with_the_controller(tmp_path):
    """The ranks of ``launcher=multinode`` are the deepspeed runner's grandchildren: each watches the
    controller named by ``HYBRIDTRAIN_CONTROLLER`` (``hybridtrain.launch.parent.watch_controller``). A stand-in
    controller starts a stand-in launcher, which starts the watching rank; the controller is SIGKILLed."""
    rank = ("import os, sys, time\nfrom hybridtrain.launch.parent import watch_controller\n"
            "assert watch_controller(os.environ['HYBRIDTRAIN_CONTROLLER'])\nprint('watching', flush=True)\n"
            "time.sleep(120)\n")
    launcher = f"import subprocess, sys, time\nsubprocess.Popen([sys.executable, '-c', {rank!r}])\ntime.sleep(120)\n"
    controller = ("import os, subprocess, sys, time\nfrom hybridtrain.launch.parent import controller_env\n"
                  f"subprocess.Popen([sys.executable, '-c', {launcher!r}], env={{**os.environ, **controller_env()}})\n"
                  "time.sleep(120)\n")
    _assert_rank_dies_with_its_controller(tmp_path, controller, rank, "watching")
