"""DeepSpeed's ``ds/*.pt`` read without running code: ``torch.load(weights_only=True)`` and an allowlist.

DeepSpeed 0.19.8's ``TorchCheckpointEngine.load`` calls ``torch.load(weights_only=False)``: unpickling a
crafted ``ds/`` file runs whatever it names, and the sha256 digests of ``meta.json`` do not stop a sender
who rewrites ``meta.json`` too. DeepSpeed has no switch for a weights-only load and no allowlist of what its
own checkpoints hold, hence this module, written by hand (about 100 lines):

- :data:`DEEPSPEED_GLOBALS`: the pickled classes and functions DeepSpeed's checkpoints hold beyond torch's
  own weights-only set, read off real ``ds/`` folders of ZeRO 0-3, pp = 2, LoRA and bf16 runs
  (``tests/unit/test_checkpoint_files.py`` re-reads them from real saves);
- :func:`foreign_global`: a static scan (no object is built) of a file's pickle, run by the controller before
  any rank starts (:func:`hybridtrain.checkpoint.io.problem`) and by the ranks on their share of ``ds/``
  before DeepSpeed opens it;
- :func:`loading_safely`: DeepSpeed's engine with its checkpoint engine swapped for one whose ``load`` is
  ``torch.load(weights_only=True)`` under :data:`DEEPSPEED_GLOBALS` (``torch.serialization.safe_globals``,
  scoped to the load). Every ``torch.load`` of DeepSpeed's same-plan resume goes through that engine
  (``engine._load_checkpoint``, ``_get_all_zero_checkpoint_state_dicts``, ``PipelineModule.load_state_dir``,
  ``load_moe_state_dict``); the two that do not (universal checkpoints, and ZeRO-3 without optimizer states
  through ``zero_to_fp32``) are never taken by hybridtrain, and :func:`loading_safely` refuses the first.
"""
from __future__ import annotations

import importlib
import re
import zipfile
from contextlib import contextmanager
from functools import lru_cache
from pathlib import Path
from typing import Iterator, Optional

DEEPSPEED_GLOBALS = (
    "deepspeed.runtime.fp16.loss_scaler.LossScaler",        # ZeRO optimizer states: the (static) loss scaler
    "deepspeed.runtime.fp16.loss_scaler.DynamicLossScaler",  # ... fp16's dynamic one (GPU runs; from the source)
    "deepspeed.runtime.zero.config.ZeroStageEnum",           # ZeRO optimizer states: the stage
    "deepspeed.utils.tensor_fragment.fragment_address",      # ZeRO-1/2: where each parameter lies in the partition
)
"""Besides torch's weights-only set (tensors, storages, ``torch.Size``, ``OrderedDict``, dtypes, ...): what
DeepSpeed's checkpoints hold. Each is a plain data class or enum whose construction runs no user input."""

_GLOBAL = re.compile(r"GLOBAL ([\w.]+)")
_UNPICKLER = re.compile(r"WeightsUnpickler error:\s*([^\n]+)")


class ForeignPickleError(RuntimeError):
    """A ``ds/`` file DeepSpeed's load met whose pickle names anything outside :data:`DEEPSPEED_GLOBALS`; the
    message (:func:`foreign_message`) names the file. :func:`~hybridtrain.checkpoint.save.load_verified` raises it
    as a ``CheckpointError``."""


@lru_cache(maxsize=None)
def allowed_globals() -> tuple:
    """The objects of :data:`DEEPSPEED_GLOBALS` (imports deepspeed)."""
    out = []
    for name in DEEPSPEED_GLOBALS:
        module, attr = name.rsplit(".", 1)
        out.append(getattr(importlib.import_module(module), attr))
    return tuple(out)


def foreign_message(path: Path, what: str) -> str:
    """The one-line refusal of ``ds/`` file ``path`` that holds ``what`` (a global's dotted name, or why it
    cannot be read as a weights-only pickle)."""
    return (f"{path} holds a pickled object outside what DeepSpeed saves ({what}); it was not written by "
            "hybridtrain: nothing of it was loaded. Resume from a checkpoint you saved yourself, or start from "
            "its safetensors weights (python -m hybridtrain.export CHECKPOINT OUT_DIR, then model.pretrained=OUT_DIR)")


def foreign_global(path: Path) -> Optional[str]:
    """Why ``path`` cannot be loaded weights-only with :data:`DEEPSPEED_GLOBALS` (``"GLOBAL module.name"`` of
    the first global outside the allowlist, or what makes the pickle unreadable), else ``None``.

    Static: torch's own scan of the archive's ``data.pkl`` (its GLOBAL opcodes; the weights-only unpickler
    supports no other way to name a global and refuses any opcode outside its set, as this scan does). Reads
    the pickle only, not the tensors' data."""
    import torch

    if not zipfile.is_zipfile(path):
        return "not a torch.save zip archive, the format DeepSpeed writes"
    try:  # names only, so the controller imports no deepspeed
        unsafe = set(torch.serialization.get_unsafe_globals_in_checkpoint(str(path))) - set(DEEPSPEED_GLOBALS)
    except Exception as err:  # noqa: BLE001 - an unreadable pickle: pickle's, zipfile's or torch's own errors
        return f"unreadable: {(str(err).splitlines() or [type(err).__name__])[0]}"  # one line
    return f"GLOBAL {sorted(unsafe)[0]}" if unsafe else None


def _engine_class():
    """DeepSpeed's ``TorchCheckpointEngine`` with a weights-only ``load`` (imports deepspeed)."""
    import pickle

    import torch
    from deepspeed.runtime.checkpoint_engine.torch_checkpoint_engine import TorchCheckpointEngine

    class WeightsOnlyCheckpointEngine(TorchCheckpointEngine):
        """Loads with ``torch.load(weights_only=True)`` under :data:`DEEPSPEED_GLOBALS`; saves as DeepSpeed does."""

        def load(self, path: str, map_location=None):
            try:
                with torch.serialization.safe_globals(list(allowed_globals())):
                    return torch.load(path, map_location=map_location, weights_only=True)
            except pickle.UnpicklingError as err:
                found, other = _GLOBAL.search(str(err)), _UNPICKLER.search(str(err))
                what = (f"GLOBAL {found.group(1)}" if found else
                        f"unreadable weights-only: {other.group(1).strip() if other else type(err).__name__}")
                raise ForeignPickleError(foreign_message(Path(path), what)) from None

    return WeightsOnlyCheckpointEngine


@contextmanager
def loading_safely(engine) -> Iterator[None]:
    """DeepSpeed ``engine`` with every ``torch.load`` of its ``load_checkpoint`` weights-only; its own checkpoint
    engine is put back afterwards (its saves are DeepSpeed's)."""
    if engine.load_universal_checkpoint():  # reads zero/*.pt with torch.load(weights_only=False) itself
        raise RuntimeError("DeepSpeed's universal checkpoint load is not weights-only; hybridtrain never enables it")
    own = engine.checkpoint_engine
    engine.checkpoint_engine = _engine_class()(engine._config)
    try:
        yield
    finally:
        engine.checkpoint_engine = own
