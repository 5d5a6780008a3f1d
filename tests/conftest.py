"""Test tiers and what every test process shares.

- ``tests/unit``: no processes; pure CPU in the pytest process (the whole tier runs in a few minutes).
- ``tests/dist``: real processes: CLI runs, deepspeed-runner jobs on gloo, the SLURM cluster.
  Items there are marked ``dist`` automatically.
- ``slow`` (marker): long sweeps (every layout of every family, ...) kept out of CI by the default
  ``-m "not slow"`` in ``pyproject.toml``; run them with ``python -m pytest -m slow``.
- ``tests/gpu``: needs CUDA; items there are marked ``gpu`` and skipped without a GPU.

The CPU tiers hide GPUs from their processes (``CUDA_VISIBLE_DEVICES=""``), so the suite behaves the
same on a GPU host; ``HYBRIDTRAIN_TEST_GPU=1`` leaves them visible (for ``tests/gpu``).

Helper modules (``launch_helpers``, ``helpers_unit``, ...) live next to this file; pytest puts this
folder on ``sys.path`` because it holds this ``conftest.py``.
"""
from __future__ import annotations

import os
from pathlib import Path

import pytest

HERE = Path(__file__).resolve().parent

if os.environ.get("HYBRIDTRAIN_TEST_GPU") != "1":
    os.environ["CUDA_VISIBLE_DEVICES"] = ""  # before torch is imported anywhere in this process


def pytest_collection_modifyitems(config, items):
    """Mark items by tier folder; skip ``gpu`` items when CUDA is not available."""
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
