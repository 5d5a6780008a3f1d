"""``python -m hybridtrain.export CHECKPOINT OUT_DIR``: a checkpoint as a HuggingFace model folder, or a
LoRA run's checkpoint as a peft adapter folder.

The checkpoint's ``hf/`` part already holds HF-named, unsharded, unpadded fp32 tensors (one file
per pipeline stage, see :mod:`hybridtrain.checkpoint.hf_state`); export merges them into
``model.safetensors`` (sharded with an index when larger than ``--max-shard-size``) next to
``config.json``, ``generation_config.json`` and the tokenizer, so ``from_pretrained`` loads the
folder as is. A tied LM head is left out, as ``save_pretrained`` does, and is tied again on load.

A LoRA checkpoint (``finetune.method=lora``) also has ``adapter/``: the adapters under peft's names, one
file per stage, and ``adapter_config.json``. Its export is the peft adapter folder
(``adapter_model.safetensors`` + ``adapter_config.json``) that ``PeftModel.from_pretrained(base, OUT_DIR)``
loads; with ``--merge`` it is instead the plain HF model with every adapter merged into its weight
(``W + s B A``, transposed for GPT-2's ``Conv1D``), computed here tensor by tensor as peft's
``merge_and_unload`` does, without building the model.

``--check`` (for checkpoints saved with ``trainer.save_logits=true``) then loads the folder with
``AutoModelForCausalLM`` and compares its fp32 logits on the checkpoint's saved micro-batch with the
logits hybridtrain computed from its sharded model, element by element.
"""
from __future__ import annotations

import argparse
import json
import math
import os
import shutil
import sys
from pathlib import Path

from hybridtrain.models.lora import ADAPTER_CONFIG, ADAPTER_WEIGHTS, LORA_A, LORA_B, hf_name_of, peft_name


class ExportError(ValueError):
    """A checkpoint that cannot be exported; the message names the path and the problem."""


def recorded_sizes(meta: dict) -> dict[str, int]:
    """``relative path -> bytes`` of a checkpoint's files as its ``meta.json`` records them (``files``:
    ``{path: size}``, or ``{path: {"size": size, ...}}`` next to a digest); ``{}`` when it records none."""
    out = {}
    for rel, entry in (meta.get("files") or {}).items():
        size = entry.get("size") if isinstance(entry, dict) else entry
        if isinstance(size, int):
            out[rel] = size
    return out


def _check_files(ckpt, folders: list[Path]) -> None:
    """Every entry of ``folders`` (``hf/``, and ``adapter/`` for a LoRA checkpoint: everything export reads or
    copies) is a regular file that ``meta.json`` lists, of the size it recorded at save time (a truncated
    shard is refused before anything is written) and, where the checkpoint records digests, of its sha256 (a
    file changed at the same size, an edited ``config.json``, would otherwise export silently). A symbolic link
    is refused, whatever it points to: export never copies what lies outside the checkpoint. A checkpoint saved
    before digests existed is checked by size only (and one without sizes, for regular files only): export is
    how such a checkpoint is carried forward."""
    from hybridtrain.checkpoint.io import DIGESTS, sha256

    meta = ckpt.meta()
    sizes, digests = recorded_sizes(meta), meta.get(DIGESTS) or {}
    listed = set(sizes) | set(digests)
    for f in sorted(p for folder in folders for p in folder.iterdir()):
        rel = str(f.relative_to(ckpt.path))
        again = "; export another checkpoint of the run"
        if f.is_symlink():
            raise ExportError(f"{f} is a symbolic link (to {os.readlink(f)}), not a file the save wrote: export "
                              f"copies nothing from outside the checkpoint{again}")
        if not f.is_file():
            raise ExportError(f"{f} is not a regular file: the save writes none there{again}")
        if listed and rel not in listed:
            raise ExportError(f"{f} is not listed in meta.json: it was added after the save, and export copies no "
                              f"unverified file{again}")
        want = sizes.get(rel)
        if want is not None and f.stat().st_size != want:
            raise ExportError(f"{f} is {f.stat().st_size} bytes but was saved with {want} (meta.json): truncated or "
                              f"corrupt{again}")
        if rel in digests and sha256(f) != digests[rel]:
            raise ExportError(f"{f} does not match its sha256 digest in meta.json: corrupt or replaced since the "
                              f"save{again}")


def _check_target(out: Path, overwrite: bool) -> None:
    """``out`` is a new or empty folder, or ``overwrite`` is given; never a file."""
    if out.exists() and not out.is_dir():
        raise ExportError(f"{out} is a file, not a folder; give a new or empty folder for the export")
    held = sorted(p.name for p in out.iterdir()) if out.is_dir() else []
    if held and not overwrite:
        shown = ", ".join(held[:5]) + (f" and {len(held) - 5} more" if len(held) > 5 else "")
        raise ExportError(f"{out} is not empty (it holds {shown}); give a new or empty folder, or --overwrite to "
                          "replace the export's files there (other files are kept)")


def export(checkpoint: str | Path, out_dir: str | Path, max_shard_size: str = "5GB", merge: bool = False,
           overwrite: bool = False) -> Path:
    """Write the HF model folder of ``checkpoint`` into ``out_dir`` (a LoRA checkpoint: its peft adapter
    folder, or with ``merge`` the HF model with the adapters merged); return ``out_dir``.

    ``out_dir`` must be new or empty unless ``overwrite``; a file there, an incomplete checkpoint, or an
    ``hf/`` or ``adapter/`` entry that is a symbolic link, not a regular file, not listed in ``meta.json``, or
    of another size or digest (:func:`_check_files`) is an :class:`ExportError` before anything is written,
    and a failed export removes the folder it created."""
    from hybridtrain.checkpoint.io import CheckpointDir

    ckpt = CheckpointDir(checkpoint)
    src = ckpt.hf
    if not ckpt.meta_file.is_file() or not src.is_dir():
        raise ExportError(f"{checkpoint} is not a complete hybridtrain checkpoint (no meta.json or hf/); "
                          "give a RUN_DIR/checkpoints/step_N folder")
    files = ckpt.hf_parts()
    if not files:
        raise ExportError(f"{src} holds no model-stage*.safetensors files")
    adapters = ckpt.adapter_parts()
    if merge and not adapters:
        raise ExportError(f"{checkpoint} holds no LoRA adapters (adapter/): --merge is for finetune.method=lora "
                          "checkpoints; export without --merge")
    _check_files(ckpt, [src, *([ckpt.adapter] if adapters else [])])
    out = Path(out_dir)
    _check_target(out, overwrite)
    created = not out.exists()
    out.mkdir(parents=True, exist_ok=True)
    try:
        if adapters and not merge:
            return _write_adapter(ckpt, out)
        return _write_model(ckpt, out, max_shard_size, adapters if merge else [])
    except BaseException:
        if created:  # no empty or half-written folder left behind
            shutil.rmtree(out, ignore_errors=True)
        raise


def _write_model(ckpt, out: Path, max_shard_size: str, adapters: list[Path]) -> Path:
    """The HF model folder of ``ckpt``'s ``hf/`` part, with the ``adapters`` files merged in when given."""
    from huggingface_hub import split_torch_state_dict_into_shards

    from hybridtrain.checkpoint.stream import save_tensors

    files = ckpt.hf_parts()
    for old in out.glob("model*.safetensors*"):  # a previous export here must not mix with this one
        old.unlink()
    tensors = _read(files)
    if adapters:
        _merge_adapters(tensors, _read(adapters), json.loads((ckpt.adapter / ADAPTER_CONFIG).read_text()))
    for f in ckpt.hf.iterdir():  # config, generation config, tokenizer (regular files, verified: _check_files)
        if f not in files:
            shutil.copyfile(f, out / f.name, follow_symlinks=False)  # new files: the umask's mode
    split = split_torch_state_dict_into_shards(tensors, filename_pattern="model{suffix}.safetensors",
                                               max_shard_size=max_shard_size)
    for filename, names in split.filename_to_tensors.items():
        save_tensors({n: tensors[n].contiguous() for n in names}, out / filename, {"format": "pt"})
    if split.is_sharded:
        index = {"metadata": {"total_size": sum(t.numel() * t.element_size() for t in tensors.values())},
                 "weight_map": split.tensor_to_filename}
        (out / "model.safetensors.index.json").write_text(json.dumps(index, indent=2))
    return out


def _read(files: list[Path]) -> dict:
    """Every tensor of the safetensors ``files`` by name."""
    from safetensors import safe_open

    tensors = {}
    for f in files:
        try:
            with safe_open(str(f), framework="pt") as handle:
                for name in handle.keys():
                    tensors[name] = handle.get_tensor(name)
        except Exception as err:  # noqa: BLE001 - safetensors raises its own error types
            raise ExportError(f"{f} is not a readable safetensors file ({err}): truncated or corrupt; export "
                              "another checkpoint of the run") from None
    return tensors


def _write_adapter(ckpt, out: Path) -> Path:
    """peft's adapter folder: the stages' adapters in ``adapter_model.safetensors``, ``adapter_config.json``."""
    from hybridtrain.checkpoint.stream import save_tensors

    save_tensors(_read(ckpt.adapter_parts()), out / ADAPTER_WEIGHTS, {"format": "pt"})
    shutil.copyfile(ckpt.adapter / ADAPTER_CONFIG, out / ADAPTER_CONFIG, follow_symlinks=False)
    return out


def _merge_adapters(tensors: dict, adapters: dict, config: dict) -> None:
    """``W += s B A`` for every adapted module of ``tensors`` (HF names) in place, in fp32; ``s`` from
    peft's ``adapter_config.json`` (``lora_alpha / r``, or ``/ sqrt(r)`` with ``use_rslora``); a
    ``fan_in_fan_out`` (``Conv1D``) weight is ``[in, out]`` and takes the transpose, as in peft's merge."""
    r = int(config["r"])
    scaling = float(config["lora_alpha"]) / (math.sqrt(r) if config.get("use_rslora") else r)
    for name, a in adapters.items():
        if not name.endswith(f".{LORA_A}.weight"):
            continue
        module = hf_name_of(name)[: -len(f".{LORA_A}.weight")]
        b = adapters[peft_name(f"{module}.{LORA_B}.weight")]
        delta = (b.float() @ a.float()) * scaling  # [out, in]
        weight = tensors[f"{module}.weight"]
        tensors[f"{module}.weight"] = (weight.float() + (delta.t() if config.get("fan_in_fan_out") else delta)).to(weight.dtype)


def check_logits(checkpoint: str | Path, out_dir: str | Path) -> tuple[float, float]:
    """``(max |transformers - hybridtrain|, max |hybridtrain|)`` over the logits of the micro-batch
    saved in ``checkpoint`` (see :mod:`hybridtrain.train.logits`), transformers reading ``out_dir``."""
    import torch
    from safetensors.torch import load_file
    from transformers import AutoModelForCausalLM

    from hybridtrain.train.logits import LOGITS_FILE

    saved_file = Path(checkpoint) / LOGITS_FILE
    if not saved_file.is_file():
        raise ExportError(f"{saved_file} does not exist: --check needs a checkpoint saved with "
                          "trainer.save_logits=true")
    saved = load_file(str(saved_file))
    if (Path(out_dir) / ADAPTER_CONFIG).is_file():  # a peft adapter folder: on its base, through peft
        model = _peft_on_base(checkpoint, out_dir)
    else:
        model = AutoModelForCausalLM.from_pretrained(str(out_dir), dtype=torch.float32).eval()
    with torch.no_grad():
        # packed rows: transformers masks the records apart from the restarting position ids too, but
        # only without a KV cache (masking_utils skips the detection with one), hence use_cache=False
        theirs = model(input_ids=saved["input_ids"], position_ids=saved.get("position_ids"),
                       use_cache=False).logits.float()
    ours = saved["logits"]
    if theirs.shape != ours.shape:
        raise ExportError(f"logits shapes differ: transformers {tuple(theirs.shape)}, hybridtrain {tuple(ours.shape)}")
    return float((theirs - ours).abs().max()), float(ours.abs().max())


def _peft_on_base(checkpoint: str | Path, adapter_dir: str | Path):
    """``PeftModel.from_pretrained(base, adapter_dir)`` with the checkpoint's base weights (its ``hf/``,
    exported to a temporary folder), in fp32 and eval mode. Needs peft."""
    import tempfile

    import torch
    from transformers import AutoModelForCausalLM

    try:
        from peft import PeftModel
    except ImportError:
        raise ExportError("--check of a LoRA adapter loads it with peft, which is not installed: "
                          "pip install 'hybridtrain[lora]'") from None
    from hybridtrain.checkpoint.io import CheckpointDir

    with tempfile.TemporaryDirectory() as tmp:
        _write_model(CheckpointDir(checkpoint), Path(tmp), "5GB", [])
        base = AutoModelForCausalLM.from_pretrained(tmp, dtype=torch.float32)
    return PeftModel.from_pretrained(base, str(adapter_dir)).eval()


def main(argv: list[str] | None = None) -> int:
    from hybridtrain.versions import require_tested_versions

    require_tested_versions()
    parser = argparse.ArgumentParser(prog="python -m hybridtrain.export", description=__doc__.splitlines()[0])
    parser.add_argument("checkpoint", help="a RUN_DIR/checkpoints/step_N folder")
    parser.add_argument("out_dir", help="where to write the HF model folder (a LoRA checkpoint: the peft adapter folder)")
    parser.add_argument("--max-shard-size", default="5GB", help="largest safetensors file (default 5GB)")
    parser.add_argument("--overwrite", action="store_true",
                        help="export into a folder that is not empty, replacing the export's files there "
                             "(an earlier export's model*.safetensors are removed; other files are kept)")
    parser.add_argument("--merge", action="store_true",
                        help="a LoRA checkpoint: write the HF model with the adapters merged into its weights "
                             "instead of the peft adapter folder")
    parser.add_argument("--check", action="store_true",
                        help="compare transformers' logits on the checkpoint's saved micro-batch with "
                             "hybridtrain's (needs trainer.save_logits=true); exit 1 when they differ")
    parser.add_argument("--tolerance", type=float, default=1e-5,
                        help="--check: largest allowed |difference| relative to the largest |logit| (fp32)")
    args = parser.parse_args(argv)
    from hybridtrain.checkpoint.io import CheckpointError

    try:
        out = export(args.checkpoint, args.out_dir, args.max_shard_size, merge=args.merge, overwrite=args.overwrite)
        print(f"[hybridtrain] exported {args.checkpoint} to {out}")
        if args.check:
            diff, scale = check_logits(args.checkpoint, out)
            ok = diff <= args.tolerance * max(1.0, scale)
            print(f"[hybridtrain] check {'passed' if ok else 'FAILED'}: max |transformers - hybridtrain| logit = "
                  f"{diff:.3g} (largest |logit| {scale:.3g}, tolerance {args.tolerance:g} relative)")
            return 0 if ok else 1
    except (ExportError, CheckpointError) as err:  # CheckpointError: a meta.json that is not what a save writes
        print(f"[hybridtrain] export error: {err}", file=sys.stderr)
        return 2
    except OSError as err:  # the output cannot be written (permissions, a full disk): one line, not a traceback
        print(f"[hybridtrain] export error: cannot write {args.out_dir}: {err}", file=sys.stderr)
        return 2
    return 0


if __name__ == "__main__":
    sys.exit(main())
