"""``scripts/gpu_check.sh`` on this CPU machine: its install step against a folder of wheels (made here, pure
Python), and its plumbing end to end in ``--dry-run`` (per-test verdicts written as each test ends, a test
stopped by pytest-timeout, a part stopped by its time limit, processes left in sessions of their own
ended, the summary to paste). The GPU tier itself needs a GPU (docs/gpu.md)."""
from __future__ import annotations

import base64
import hashlib
import json
import os
import subprocess
import sys
import time
import zipfile
from pathlib import Path

import pytest

from helpers.launch import REPO

SCRIPT = REPO / "scripts" / "gpu_check.sh"


def _wheel(folder: Path, name: str, files: dict[str, str], requires: tuple[str, ...] = ()) -> Path:
    """A pure-Python wheel ``name-1.0-py3-none-any.whl`` holding ``files`` (path -> text)."""
    dist = f"{name}-1.0.dist-info"
    meta = {f"{dist}/METADATA": "Metadata-Version: 2.1\nName: {}\nVersion: 1.0\n{}".format(
                name, "".join(f"Requires-Dist: {r}\n" for r in requires)),
            f"{dist}/WHEEL": "Wheel-Version: 1.0\nGenerator: test\nRoot-Is-Purelib: true\nTag: py3-none-any\n",
            f"{dist}/top_level.txt": "\n".join(sorted({p.split("/")[0].removesuffix(".py") for p in files})) + "\n"}
    content = {**files, **meta}
    record = [f"{p},sha256={base64.urlsafe_b64encode(hashlib.sha256(t.encode()).digest()).rstrip(b'=').decode()},"
              f"{len(t.encode())}" for p, t in content.items()] + [f"{dist}/RECORD,,"]
    path = folder / f"{name}-1.0-py3-none-any.whl"
    with zipfile.ZipFile(path, "w") as z:
        for p, t in content.items():
            z.writestr(p, t)
        z.writestr(f"{dist}/RECORD", "\n".join(record) + "\n")
    return path


def _run(tmp_path: Path, *args: str, env: dict | None = None, timeout: float = 300) -> subprocess.CompletedProcess:
    return subprocess.run(["bash", str(SCRIPT), "--results", str(tmp_path / "results"), *args], cwd=REPO,
                          env=dict(os.environ, GPU_CHECK_SITE=str(tmp_path / "site"), **(env or {})),
                          capture_output=True, text=True, timeout=timeout)


def test_install_step_puts_the_wheels_first_on_the_path_and_imports_them(tmp_path):
    """The wheels go into the --target folder with --no-deps (a requirement met by another wheel of the
    folder is not fetched), each top-level module is imported from there, and hybridtrain's version check
    runs; nothing is installed into the environment itself."""
    wheels = tmp_path / "wheels"
    wheels.mkdir()
    _wheel(wheels, "htcheck_alpha", {"htcheck_alpha/__init__.py": "VALUE = 41\n"})
    _wheel(wheels, "htcheck_beta", {"htcheck_beta.py": "import htcheck_alpha\nVALUE = htcheck_alpha.VALUE + 1\n"},
           requires=("htcheck_alpha>=1", "htcheck-missing-everywhere>=9; python_version < '3'"))
    proc = _run(tmp_path, "--dry-run", "--install-only", "--wheels", str(wheels))
    assert proc.returncode == 0, proc.stdout + proc.stderr
    site = tmp_path / "site"
    assert f"imported 2 of 2 modules from {site.resolve()}: htcheck_alpha, htcheck_beta" in proc.stdout, proc.stdout
    assert "installed and checked" in proc.stdout
    show = "import htcheck_beta; print(htcheck_beta.VALUE, htcheck_beta.__file__)"
    got = subprocess.run([sys.executable, "-c", show],
                         env=dict(os.environ, PYTHONPATH=str(site)), capture_output=True, text=True)
    assert got.stdout.split() == ["42", str(site / "htcheck_beta.py")], got.stdout + got.stderr
    outside = subprocess.run([sys.executable, "-c", "import htcheck_alpha"], capture_output=True, text=True)
    assert outside.returncode != 0  # only in the target folder


def test_install_step_stops_on_a_wheel_that_does_not_import_or_a_folder_without_wheels(tmp_path):
    wheels = tmp_path / "wheels"
    wheels.mkdir()
    _wheel(wheels, "htcheck_broken", {"htcheck_broken/__init__.py": "import htcheck_not_there\n"})
    proc = _run(tmp_path, "--dry-run", "--install-only", "--wheels", str(wheels))
    assert proc.returncode == 2, proc.stdout + proc.stderr
    assert "the carried wheels do not import from" in proc.stdout
    assert "htcheck_broken: ModuleNotFoundError: No module named 'htcheck_not_there'" in proc.stdout, proc.stdout
    empty = tmp_path / "empty"
    empty.mkdir()
    (empty / "deepspeed-0.19.8.tar.gz").write_text("an sdist: the check builds nothing")
    proc = _run(tmp_path, "--dry-run", "--install-only", "--wheels", str(empty))
    assert proc.returncode == 2 and f"no wheels in {empty}" in proc.stdout, proc.stdout + proc.stderr


def test_the_check_without_dry_run_stops_where_torch_sees_no_gpu(tmp_path):
    proc = _run(tmp_path)  # this CPU machine (the tests hide GPUs), before installing anything
    assert proc.returncode == 2, proc.stdout + proc.stderr
    assert "torch sees no CUDA device: this check needs torch's CUDA build and a GPU" in proc.stdout
    assert "installing" not in proc.stdout


PLUMBING = '''
import os, subprocess, time
import pytest

def test_passes():
    pass

def test_leaves_a_process_in_its_own_session(tmp_path):
    proc = subprocess.Popen(["sleep", "300"], start_new_session=True)  # as a rank does
    open(os.environ["ORPHAN_PID_FILE"], "w").write(str(proc.pid))

def test_hangs_past_the_per_test_timeout():
    time.sleep(60)

@pytest.mark.timeout(600)
def test_hangs_past_the_part_limit():
    time.sleep(600)
'''

CONFTEST = f'''
import importlib.util
spec = importlib.util.spec_from_file_location("gpu_verdicts", {str(REPO / "tests" / "gpu" / "conftest.py")!r})
mod = importlib.util.module_from_spec(spec)
spec.loader.exec_module(mod)
pytest_configure = mod.pytest_configure
'''


def _alive(pid: int) -> bool:
    try:
        state = Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()[0]
    except OSError:
        return False
    return state != "Z"  # a zombie holds nothing


def test_dry_run_plumbing_verdicts_timeouts_and_left_processes(tmp_path):
    """The script's own parts with stand-in tests: each verdict is in verdicts.jsonl as the test ends, a
    test stopped by pytest-timeout fails, the test running when the part's time limit stops pytest is
    listed as stopped, the process a test left in a session of its own is ended, the summary is printed,
    and the dry run fails because a test was not skipped for the missing GPU."""
    tests = tmp_path / "standin"
    tests.mkdir()
    (tests / "test_standin.py").write_text(PLUMBING)
    (tests / "conftest.py").write_text(CONFTEST)
    pid_file = tmp_path / "orphan.pid"
    t0 = time.monotonic()
    proc = _run(tmp_path, "--dry-run", "--workers", "1",
                env={"GPU_CHECK_TESTS": str(tests), "GPU_CHECK_BENCH": f"{tests}/test_standin.py::test_passes",
                     "GPU_CHECK_TEST_TIMEOUT": "3", "GPU_CHECK_BUDGET_S": "40", "GPU_CHECK_BENCH_S": "0",
                     "ORPHAN_PID_FILE": str(pid_file)})
    assert time.monotonic() - t0 < 120
    out = proc.stdout + proc.stderr
    assert proc.returncode == 1 and "dry run: not skipped for the missing GPU" in out, out
    assert "tier: stopped at its limit" in out and "no time left for the benchmark test" in out, out
    pid = int(pid_file.read_text())
    assert "process(es) left running" in out and not _alive(pid), out
    (folder,) = (tmp_path / "results").glob("gpu_check_*_dry")
    records = [json.loads(line) for line in (folder / "verdicts.jsonl").read_text().splitlines()]
    verdicts = {r["test"].split("::")[-1]: r for r in records if r["event"] == "verdict"}
    assert verdicts["test_passes"]["outcome"] == "passed"
    assert verdicts["test_leaves_a_process_in_its_own_session"]["outcome"] == "passed"
    assert verdicts["test_hangs_past_the_per_test_timeout"]["outcome"] == "failed"
    assert "Timeout" in verdicts["test_hangs_past_the_per_test_timeout"]["reason"]
    started = [r["test"].split("::")[-1] for r in records if r["event"] == "start"]
    assert started[-1] == "test_hangs_past_the_part_limit" and started[-1] not in verdicts
    summary = (folder / "summary.md").read_text()
    assert "| `test_hangs_past_the_part_limit` | stopped (no verdict: time limit or killed) |" in summary
    assert "2 passed, 1 failed, 0 skipped, 1 stopped or in error" in summary
    assert "----- paste into docs/gpu.md" in out
    assert sorted(p.name for p in folder.iterdir()) == ["check.log", "summary.md", "tier.log", "verdicts.jsonl"]


@pytest.mark.slow  # about 2 minutes; CI keeps the script's parts with stand-in tests (the test above)
def test_dry_run_of_the_gpu_tier_skips_every_test_for_the_missing_gpu(tmp_path):
    """The whole check as the GPU machine runs it, here without a GPU: the real tier and benchmark test run
    (xdist workers, verdict log) and every test skips because there is no GPU; exit 0, results and summary
    written, and, with $OUT set, copied there."""
    out_dir = tmp_path / "out"
    out_dir.mkdir()
    proc = _run(tmp_path, "--dry-run", env={"OUT": str(out_dir)}, timeout=600)
    out = proc.stdout + proc.stderr
    assert proc.returncode == 0, out
    (folder,) = (tmp_path / "results").glob("gpu_check_*_dry")
    records = [json.loads(line) for line in (folder / "verdicts.jsonl").read_text().splitlines()]
    verdicts = [r for r in records if r["event"] == "verdict"]
    names = {r["test"].split("::")[-1].split("@")[0] for r in verdicts}
    assert {"test_single_gpu_mfu_benchmark", "test_tp2_checkpoint_save_and_resume",
            "test_bf16_checkpoint_resumes_exactly_exports_and_keeps_the_cuda_rng"} <= names
    assert all(r["outcome"] == "skipped" and "needs an NVIDIA GPU" in r["reason"] for r in verdicts), verdicts
    assert "0 passed, 0 failed" in (folder / "summary.md").read_text()
    assert sorted(p.name for p in (out_dir / folder.name).iterdir()) == sorted(p.name for p in folder.iterdir())
