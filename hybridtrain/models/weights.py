"""Reading HF weights from a local ``save_pretrained`` folder through safetensors.

Only safetensors are read (never pickles), one tensor at a time, so a rank touches just the
units of its own pipeline stage. Both a single ``model.safetensors`` and sharded checkpoints
(``model.safetensors.index.json``) work.
"""
from __future__ import annotations

import json
from pathlib import Path
from typing import Iterable

import torch


class CheckpointError(ValueError):
    """A model folder that cannot be loaded; the message names the file and what is wrong."""


class SafetensorsWeights:
    """HF-named tensors of a local model folder."""

    def __init__(self, folder: str | Path):
        self.folder = Path(folder)
        index = self.folder / "model.safetensors.index.json"
        single = self.folder / "model.safetensors"
        if index.is_file():
            try:
                weight_map = json.loads(index.read_text())["weight_map"]
            except (ValueError, KeyError) as err:
                raise CheckpointError(f"{index} is not a valid safetensors index: {err}") from None
            self._file_of = {name: self.folder / fname for name, fname in weight_map.items()}
        elif single.is_file():
            from safetensors import safe_open

            try:
                with safe_open(str(single), framework="pt") as f:
                    self._file_of = {name: single for name in f.keys()}
            except Exception as err:  # noqa: BLE001 - safetensors raises its own error types
                raise CheckpointError(f"{single} is not a readable safetensors file ({err}); "
                                      "the file may be truncated or corrupt") from None
        elif any(self.folder.glob("*.safetensors")):  # a hybridtrain checkpoint part: one file per stage
            from safetensors import safe_open

            self._file_of = {}
            for path in sorted(self.folder.glob("*.safetensors")):
                with safe_open(str(path), framework="pt") as f:
                    self._file_of.update({name: path for name in f.keys()})
        else:
            raise CheckpointError(f"{self.folder} has no model.safetensors or model.safetensors.index.json "
                                  "(only safetensors weights are loaded; re-save with save_pretrained)")
        self._handles: dict[Path, object] = {}

    def names(self) -> Iterable[str]:
        return self._file_of.keys()

    def __contains__(self, name: str) -> bool:
        return name in self._file_of

    def get(self, name: str) -> torch.Tensor:
        """The full tensor ``name`` as float32."""
        from safetensors import safe_open

        path = self._file_of.get(name)
        if path is None:
            raise CheckpointError(f"{self.folder}: tensor {name!r} is missing from the checkpoint")
        if path not in self._handles:
            try:
                self._handles[path] = safe_open(str(path), framework="pt")
            except Exception as err:  # noqa: BLE001
                raise CheckpointError(f"{path} is not a readable safetensors file ({err}); "
                                      "the file may be truncated or corrupt") from None
        try:
            return self._handles[path].get_tensor(name).float()
        except Exception as err:  # noqa: BLE001
            raise CheckpointError(f"{path}: cannot read {name!r} ({err}); the file may be truncated or corrupt") from None


    def sliced(self, name: str, cut):
        """``cut(view)`` on a safetensors slice view of tensor ``name``: reads only what ``cut``
        indexes. Errors name the file."""
        from safetensors import safe_open

        path = self._file_of.get(name)
        if path is None:
            raise CheckpointError(f"{self.folder}: tensor {name!r} is missing from the checkpoint")
        try:
            with safe_open(str(path), framework="pt") as f:
                return cut(f.get_slice(name))
        except Exception as err:  # noqa: BLE001 - safetensors raises its own error types
            raise CheckpointError(f"{path}: cannot read {name!r} ({err}); the file may be truncated or corrupt") from None


def read_shard(weights: SafetensorsWeights, name: str, dim: int, fused: int, rank: int, size: int) -> torch.Tensor:
    """Only this rank's part of tensor ``name``: along ``dim`` (HF layout), each of ``fused`` equal
    sub-blocks cut into ``size`` chunks, chunk ``rank`` of each, read with safetensors slicing."""

    from hybridtrain.parallel.slicing import shard_ranges

    def cut(view):
        ranges = shard_ranges(view.get_shape()[dim], fused, rank, size)
        return [view[lo:hi] if dim == 0 else view[:, lo:hi] for lo, hi in ranges]

    return torch.cat(weights.sliced(name, cut), dim=dim).float()


def read_rows(weights: SafetensorsWeights, name: str, lo: int, hi: int) -> tuple[torch.Tensor, tuple]:
    """Rows ``[lo, hi)`` of tensor ``name`` (clipped to its length) and the tensor's full shape."""

    def cut(view):
        shape = tuple(view.get_shape())
        return view[min(lo, shape[0]):min(hi, shape[0])], shape

    rows, shape = weights.sliced(name, cut)
    return rows.float(), shape


def load_unit(unit: torch.nn.Module, prefix: str, weights: SafetensorsWeights, tied_from: dict[str, str],
              skip: tuple[str, ...] = ()) -> None:
    """Fill every parameter of ``unit`` (HF path ``prefix``) from ``weights``, checking shapes.

    ``tied_from`` maps a name missing from the file to the one it is tied to (``lm_head.weight``
    -> the embedding), as ``save_pretrained`` omits tied copies.
    """
    for local, param in unit.named_parameters():
        if local.startswith(skip):  # read elsewhere, shard by shard
            continue
        name = f"{prefix}.{local}"
        if name not in weights and name in tied_from:
            name = tied_from[name]
        tensor = weights.get(name)
        if tuple(tensor.shape) != tuple(param.shape):
            raise CheckpointError(f"{weights.folder}: {name} has shape {tuple(tensor.shape)} but the configured "
                                  f"model expects {tuple(param.shape)}; the model config does not match the checkpoint")
        with torch.no_grad():
            param.copy_(tensor)
