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


PICKLES = ("pytorch_model.bin", "pytorch_model.bin.index.json", "model.bin", "tf_model.h5", "flax_model.msgpack")
"""Weight files of other formats, which are never loaded (a pickle can run code when loaded)."""


def no_weights(folder: Path) -> str:
    """Why ``folder`` has no weights hybridtrain loads, and how to get them."""
    found = [name for name in PICKLES if (folder / name).is_file()] + sorted(p.name for p in folder.glob("pytorch_model-*.bin"))[:1]
    if found:
        return (f"{folder} holds {found[0]}, not safetensors: hybridtrain loads only model.safetensors (or a sharded "
                "model.safetensors.index.json), never a pickle, which can run code when loaded; convert it once, "
                f"where you trust the file: python -c \"from transformers import AutoModelForCausalLM as M; "
                f"M.from_pretrained('{folder}').save_pretrained('{folder}-safetensors')\" and set "
                f"model.pretrained={folder}-safetensors")
    return (f"{folder} has config.json but no weights (no model.safetensors or model.safetensors.index.json); "
            "give the folder written by save_pretrained, with its weights")


def stored_names(stored: Iterable[str], model: torch.nn.Module) -> dict[str, str]:
    """``name in model -> stored name`` for the tensors ``stored`` in a folder, through transformers' own
    key mapping for ``model`` (what ``from_pretrained`` applies: renamed old names such as GPT-NeoX's
    ``embed_out`` or ``LayerNorm.gamma``, and the base-model prefix a base-model checkpoint lacks).
    Names a conversion would have to compute (merged or split tensors) are left out."""
    try:
        from transformers.conversion_mapping import get_model_conversion_mapping
        from transformers.core_model_loading import WeightConverter, WeightRenaming, rename_source_key
    except ImportError:  # a transformers without the mapping: the stored names as they are
        return {name: name for name in stored}
    transforms = get_model_conversion_mapping(model)
    renamings = [t for t in transforms if isinstance(t, WeightRenaming)]
    converters = [t for t in transforms if isinstance(t, WeightConverter)]
    state = model.state_dict()
    out: dict[str, str] = {}
    for key in stored:
        name, converted = rename_source_key(key, renamings, converters, model.base_model_prefix, state)
        if converted is None:
            out.setdefault(name, key)
    return out


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
            raise CheckpointError(no_weights(self.folder))
        self._handles: dict[Path, object] = {}
        self._stored: dict[str, str] = {}

    def names(self) -> Iterable[str]:
        """The tensor names as stored in the folder."""
        return self._file_of.keys()

    def for_model(self, model: torch.nn.Module) -> "SafetensorsWeights":
        """Read the tensors of ``model``'s parameters under the names the folder stores them by
        (:func:`stored_names`: transformers' own renaming of old names and base-model prefixes); ``self``."""
        self._stored = {name: stored for name, stored in stored_names(self.names(), model).items() if name != stored}
        return self

    def headers(self) -> dict[str, tuple[tuple[int, ...], str]]:
        """``stored name -> (shape, safetensors dtype)`` of every tensor, from the files' headers only
        (no tensor data is read). ``safe_open`` checks that each header is valid and that the tensors it
        declares fit the file (a truncated or garbage file fails here); a sharded index naming a file
        that is missing or does not hold the tensor is an error too."""
        from safetensors import safe_open

        out: dict[str, tuple[tuple[int, ...], str]] = {}
        by_file: dict[Path, list[str]] = {}
        for name, path in self._file_of.items():
            by_file.setdefault(path, []).append(name)
        for path, names in by_file.items():
            if not path.is_file():
                raise CheckpointError(f"{path} is named by {self.folder / 'model.safetensors.index.json'} but does not "
                                      "exist; the download or copy is incomplete")
            try:
                with safe_open(str(path), framework="pt") as f:
                    held = set(f.keys())
                    for name in names:
                        if name not in held:
                            raise CheckpointError(f"{path} does not hold {name!r}, which the index names; the index "
                                                  "and the shards do not belong together")
                        view = f.get_slice(name)
                        out[name] = (tuple(view.get_shape()), str(view.get_dtype()))
            except CheckpointError:
                raise
            except Exception as err:  # noqa: BLE001 - safetensors raises its own error types
                raise CheckpointError(f"{path} is not a readable safetensors file ({err}); the file may be "
                                      "truncated or corrupt") from None
        return out

    def __contains__(self, name: str) -> bool:
        return self._stored.get(name, name) in self._file_of

    def get(self, name: str) -> torch.Tensor:
        """The full tensor ``name`` as float32."""
        from safetensors import safe_open

        name = self._stored.get(name, name)
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

        name = self._stored.get(name, name)
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
