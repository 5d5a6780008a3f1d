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

    def __init__(self, folder: str | Path, renames: tuple[tuple[str, str], ...] = ()):
        self.folder = Path(folder)
        self.renames = tuple(renames)
        """``(model's name part, checkpoint's)`` pairs tried for a name the folder lacks (Mixtral's ``.mlp.`` is
        ``.block_sparse_moe.`` in its published checkpoints: :func:`checkpoint_renames`)."""
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
        self._renamed: dict[str, str] = {}

    def names(self) -> Iterable[str]:
        """The tensor names as stored in the folder."""
        return self._file_of.keys()

    def for_model(self, model: torch.nn.Module) -> "SafetensorsWeights":
        """Read the tensors of ``model``'s parameters under the names the folder stores them by
        (:func:`stored_names`: transformers' own renaming of old names and base-model prefixes); ``self``."""
        self._renamed = {name: stored for name, stored in stored_names(self.names(), model).items() if name != stored}
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


    def _stored(self, name: str) -> str:
        """The name tensor ``name`` has in the folder: itself, its name under transformers' renaming
        (:meth:`for_model`), or itself under :attr:`renames`."""
        name = self._renamed.get(name, name)
        if name in self._file_of:
            return name
        for ours, theirs in self.renames:
            if ours in name and name.replace(ours, theirs) in self._file_of:
                return name.replace(ours, theirs)
        return name

    def __contains__(self, name: str) -> bool:
        return self._stored(name) in self._file_of

    def get(self, name: str) -> torch.Tensor:
        """The full tensor ``name`` as float32."""
        from safetensors import safe_open

        name = self._stored(name)
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

        name = self._stored(name)
        path = self._file_of.get(name)
        if path is None:
            raise CheckpointError(f"{self.folder}: tensor {name!r} is missing from the checkpoint")
        try:
            with safe_open(str(path), framework="pt") as f:
                return cut(f.get_slice(name))
        except Exception as err:  # noqa: BLE001 - safetensors raises its own error types
            raise CheckpointError(f"{path}: cannot read {name!r} ({err}); the file may be truncated or corrupt") from None


def read_shard(weights: SafetensorsWeights, name: str, dim: int, fused: int, rank: int, size: int,
               experts: tuple[int, int] | None = None) -> torch.Tensor:
    """Only this rank's part of tensor ``name``: along ``dim`` (HF layout), each of ``fused`` equal
    sub-blocks cut into ``size`` chunks, chunk ``rank`` of each, read with safetensors slicing. ``experts``
    ``(ep_rank, ep)``: of a 3-D experts tensor (``dim`` >= 1) only that expert-parallel rank's equal run of
    dimension 0 too (its ``E / ep`` experts)."""

    from hybridtrain.parallel.slicing import shard_ranges

    def cut(view):
        shape = view.get_shape()
        ranges = shard_ranges(shape[dim], fused, rank, size)
        lead: tuple = (slice(None),) * dim
        if experts is not None:  # [E / ep, ...] of [E, ...]
            assert dim >= 1 and shape[0] % experts[1] == 0, (name, shape, experts)
            step = shape[0] // experts[1]
            lead = (slice(experts[0] * step, (experts[0] + 1) * step),) + lead[1:]
        return [view[lead + (slice(lo, hi),)] for lo, hi in ranges]  # any dim (3-D experts: 1, 2)

    return torch.cat(weights.sliced(name, cut), dim=dim).float()


def read_expert_rows(weights: SafetensorsWeights, name: str, ep_rank: int, ep: int) -> torch.Tensor:
    """Expert-parallel rank ``ep_rank``'s ``E / ep`` rows of a per-expert tensor ``name`` kept whole over tensor
    parallelism (gpt-oss's ``down_proj_bias [E, H]``)."""
    experts = int(weights.sliced(name, lambda view: view.get_shape()[0]))
    step = experts // ep
    rows, _ = read_rows(weights, name, ep_rank * step, (ep_rank + 1) * step)
    return rows


def read_experts_shard(weights: SafetensorsWeights, name: str, dim: int, fused: int, rank: int, size: int,
                       model_type: str, experts: tuple[int, int] | None = None) -> torch.Tensor:
    """This rank's part of a fused 3-D experts tensor ``name`` (``...mlp.experts.gate_up_proj [E, 2I, H]``,
    ``down_proj [E, H, I]``), split along ``dim`` (1 or 2; ``fused`` blocks): read as it is where the folder
    holds it fused (hybridtrain's own checkpoints), else from the per-expert 2-D tensors ``save_pretrained``
    and the published checkpoints hold (``mlp.experts.3.gate_proj.weight`` ...), by transformers' own
    conversion for ``model_type`` (``transformers.conversion_mapping``: ``MergeModulelist(dim=0)`` over the
    experts, then ``Concatenate(dim=1)`` of gate and up). Each per-expert tensor is read as its slice only. ``experts``
    ``(ep_rank, ep)``: only that expert-parallel rank's ``E / ep`` experts (the others are not read)."""
    if name in weights:
        return read_shard(weights, name, dim, fused, rank, size, experts)
    sources = _expert_sources(name, model_type)
    if sources is None or fused not in (1, len(sources)):
        raise CheckpointError(f"{weights.folder}: tensor {name!r} is missing from the checkpoint, and transformers' "
                              f"conversion for {model_type!r} gives no per-expert tensors it is made of")
    parts = []
    for pattern in sources:  # gate, then up (Concatenate(dim=1) of the merged lists)
        count = 0
        while pattern.replace("*", str(count)) in weights:
            count += 1
        if not count:
            raise CheckpointError(f"{weights.folder}: neither {name!r} nor its per-expert tensors "
                                  f"{pattern.replace('*', '0')!r}, ... are in the checkpoint")
        ids = range(count)
        if experts is not None:  # this expert-parallel rank's run of the experts
            step = count // experts[1]
            ids = range(experts[0] * step, (experts[0] + 1) * step)
        rows = [read_shard(weights, pattern.replace("*", str(e)), dim - 1, 1, rank, size) for e in ids]
        parts.append(torch.stack(rows))  # MergeModulelist(dim=0): [E, ...] (or [E / ep, ...])
    return torch.cat(parts, dim=1)


def checkpoint_renames(model_type: str) -> tuple[tuple[str, str], ...]:
    """transformers' renamings of ``model_type``'s checkpoint names (``WeightRenaming`` of its conversion table,
    e.g. Mixtral's ``.block_sparse_moe.`` -> ``.mlp.``) as ``(model's, checkpoint's)`` pairs."""
    from transformers.conversion_mapping import get_checkpoint_conversion_mapping

    return tuple((rule.target_patterns[0], rule.source_patterns[0])
                 for rule in get_checkpoint_conversion_mapping(model_type) or []
                 if type(rule).__name__ == "WeightRenaming" and len(rule.source_patterns) == 1
                 and "\\" not in rule.source_patterns[0] and "^" not in rule.source_patterns[0])


def _expert_sources(name: str, model_type: str) -> list[str] | None:
    """The per-expert source names (``*`` = expert index) of fused tensor ``name`` in transformers'
    conversion mapping of ``model_type``, with its renamings undone; ``None`` where it has none."""
    from transformers.conversion_mapping import get_checkpoint_conversion_mapping

    rules = get_checkpoint_conversion_mapping(model_type) or []
    for rule in rules:
        targets = list(getattr(rule, "target_patterns", None) or [])
        ops = [type(op).__name__ for op in getattr(rule, "operations", None) or []]
        if len(targets) != 1 or not name.endswith(targets[0]) or ops[:1] != ["MergeModulelist"]:
            continue
        if any(op not in ("MergeModulelist", "Concatenate") for op in ops):
            return None
        stem = name[: len(name) - len(targets[0])]
        for renaming in rules:  # e.g. Mixtral's ".block_sparse_moe." -> ".mlp." (a checkpoint has the former)
            if type(renaming).__name__ == "WeightRenaming":
                src, dst = renaming.source_patterns[0], renaming.target_patterns[0]
                stem = stem.replace(dst, src)
        return [stem + pattern.lstrip(".") if stem.endswith(".") else stem + pattern
                for pattern in rule.source_patterns]
    return None


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
    for local, buffer in unit.named_buffers():  # persistent buffers the checkpoint holds (a router's bias)
        name = f"{prefix}.{local}"
        if name in weights:
            tensor = weights.get(name)
            if tuple(tensor.shape) != tuple(buffer.shape):
                raise CheckpointError(f"{weights.folder}: {name} has shape {tuple(tensor.shape)} but the configured "
                                      f"model expects {tuple(buffer.shape)}; the model config does not match the "
                                      "checkpoint")
            with torch.no_grad():
                buffer.copy_(tensor)
