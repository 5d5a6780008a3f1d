"""Test tiers and what every test process shares.

- ``tests/unit``: no processes; pure CPU in the pytest process (the whole tier runs in a few minutes).
- ``tests/dist``: real processes: CLI runs, deepspeed-runner jobs on gloo, the SLURM cluster.
  Items there are marked ``dist`` automatically.
- ``slow`` (marker): long sweeps (every layout of every family, ...) kept out of CI by the default
  ``-m "not slow"`` in ``pyproject.toml``; run them with ``python -m pytest -m slow``.
- ``tests/gpu``: needs CUDA; items there are marked ``gpu`` and skipped without a GPU.

The CPU tiers hide GPUs from their processes (``CUDA_VISIBLE_DEVICES=""``), so the suite behaves the
same on a GPU host; ``HYBRIDTRAIN_TEST_GPU=1`` leaves them visible (for ``tests/gpu``).

Helpers live in the package ``tests/helpers/`` (``from helpers.launch import run_cli``); pytest puts this
folder on ``sys.path`` because it holds this ``conftest.py``. The fixtures below are the tiny model folders
several modules read (made once per test process).
"""
from __future__ import annotations

import os
from pathlib import Path

import pytest

HERE = Path(__file__).resolve().parent

if os.environ.get("HYBRIDTRAIN_TEST_GPU") != "1":
    os.environ["CUDA_VISIBLE_DEVICES"] = ""  # before torch is imported anywhere in this process

# CI runs two workers on two cores, and every job (and every in-process test) sizes its OpenMP threads for
# the whole machine. OpenMP's default wait policy spins at each barrier, so when both workers compute the
# threads burn the cores waiting for each other, several times the CPU time of passive waiting
# (docs/benchmarks.md). Before libgomp is loaded; the ranks inherit it; a value already set is kept.
os.environ.setdefault("OMP_WAIT_POLICY", "PASSIVE")

# Nothing in the suite downloads: the HF libraries are offline from the start, as every run puts them
# (hybridtrain.data.sources.offline). Set here, before any of them is imported, the test processes, the runs
# and the warm-start server (warm_starts) agree on them, so a test that reads data in this process before it
# starts a run still gets a warm one.
os.environ.setdefault("HF_HUB_OFFLINE", "1")
os.environ.setdefault("HF_DATASETS_OFFLINE", "1")


LONGEST_FIRST = ("test_parity.py", "test_checkpoint.py", "test_slurm.py", "test_bf16_accum.py",
                 "test_packing_layouts.py", "test_lora_peft.py", "test_faults.py", "test_data_e2e.py",
                 "test_dpo.py")
"""The dist modules that take longest (``--durations``), started first. CI runs the suite on two
workers (``-n 2 --dist loadfile``: a module stays on one worker, so its module fixtures, the SLURM
cluster among them, are made once); a long module started last would leave one worker idle at the end,
so these go first, then the other dist modules, then the many short unit modules."""


@pytest.fixture(scope="session", autouse=True)
def warm_starts(request, tmp_path_factory):
    """In a test process that runs dist tests, a warm-start server (:mod:`hybridtrain.warmstart`) that forks the
    runs of :func:`hybridtrain.cli.run` (``run_cli``) whose environment is the default one, so that each skips
    the seconds of importing torch, transformers, Hydra and DeepSpeed in its controller and preload process;
    ``HYBRIDTRAIN_TEST_WARM=0`` starts every run as a fresh interpreter (what ``tests/dist/test_warmstart.py``
    compares a warm run with)."""
    from hybridtrain.cli import WARM_START, environment

    dist = any("dist" in Path(str(item.fspath)).resolve().relative_to(HERE).parts[:1] for item in request.session.items)
    if not dist or os.environ.get("HYBRIDTRAIN_TEST_WARM") == "0" or WARM_START in os.environ:
        yield None
        return
    from hybridtrain.warmstart import Server

    folder = tmp_path_factory.mktemp("warm")
    os.environ[WARM_START] = str(folder / "warm.sock")  # before the server takes its environment
    server = Server(folder, environment(None))
    try:
        yield server
    finally:
        server.close()
        os.environ.pop(WARM_START, None)


@pytest.fixture(autouse=True)
def own_environment():
    """Each test gets the session's environment back when it ends: what code run in this process sets there
    (``hybridtrain.data.sources`` puts the HF libraries offline, a logger sets ``WANDB_MODE``) does not leak
    into later tests, nor into the environment of their runs, which the warm-start server (:func:`warm_starts`)
    serves only when it is the one it started with."""
    before = dict(os.environ)
    yield
    if os.environ != before:
        os.environ.clear()
        os.environ.update(before)


@pytest.fixture(scope="session")
def family_folders(tmp_path_factory) -> dict[str, Path]:
    """One tiny ``save_pretrained`` checkpoint per model family (:data:`helpers.families.TINY`, the embedded
    tokenizer), made once per test process; tests read them, never write into them."""
    from helpers.families import TINY, make_family_checkpoint

    root = tmp_path_factory.mktemp("families")
    return {f: make_family_checkpoint(root / f, f) for f in sorted(TINY)}


@pytest.fixture(scope="session")
def hf_checkpoints(tmp_path_factory) -> dict[str, Path]:
    """The fine-tuning tests' HF folders (:func:`helpers.finetune.make_checkpoint`): ``llama`` (grouped-query
    attention, sharded over several safetensors files with an index) and ``gpt2`` (tied head); read only."""
    from helpers.finetune import make_checkpoint

    root = tmp_path_factory.mktemp("hf")
    return {"llama": make_checkpoint(root / "llama", "llama", sharded=True),
            "gpt2": make_checkpoint(root / "gpt2", "gpt2")}


@pytest.fixture(scope="session")
def hf_llama(tmp_path_factory) -> Path:
    """A tiny ``save_pretrained`` Llama in one safetensors file (:func:`helpers.finetune.make_checkpoint`), for
    recipes that fine-tune one (``model.pretrained``) and the bad-folder tests (which copy it before breaking it)."""
    from helpers.finetune import make_checkpoint

    return make_checkpoint(tmp_path_factory.mktemp("hf_llama") / "llama", "llama")


def _run_order(item) -> tuple[int, int]:
    rel = Path(str(item.fspath)).resolve().relative_to(HERE).parts
    name = rel[-1]
    if name in LONGEST_FIRST:
        return 0, LONGEST_FIRST.index(name)
    return (1, 0) if rel[0] == "dist" else (2, 0)


def pytest_collection_modifyitems(config, items):
    """Order items longest module first (:data:`LONGEST_FIRST`); mark items by tier folder; skip
    ``gpu`` items when CUDA is not available."""
    items.sort(key=_run_order)  # stable: each module's own order is kept
    gpu_skip = None
    for item in items:
        rel = Path(str(item.fspath)).resolve().relative_to(HERE).parts
        if rel[0] == "dist":
            item.add_marker(pytest.mark.dist)
        elif rel[0] == "gpu":
            item.add_marker(pytest.mark.gpu)
            if gpu_skip is None:
                import torch

                gpu_skip = pytest.mark.skip(reason="needs an NVIDIA GPU (torch.cuda.is_available() is False; "
                                                   "HYBRIDTRAIN_TEST_GPU=1 leaves GPUs visible)") \
                    if not torch.cuda.is_available() else False
            if gpu_skip:
                item.add_marker(gpu_skip)
