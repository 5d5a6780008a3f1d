"""``python -m hybridtrain.export CHECKPOINT OUT_DIR``: a checkpoint as a HuggingFace model folder.

The checkpoint's ``hf/`` part already holds HF-named, unsharded, unpadded fp32 tensors (one file
per pipeline stage, see :mod:`hybridtrain.checkpoint.hf_state`); export merges them into
``model.safetensors`` (sharded with an index when larger than ``--max-shard-size``) next to
``config.json``, ``generation_config.json`` and the tokenizer, so ``from_pretrained`` loads the
folder as is. A tied LM head is left out, as ``save_pretrained`` does, and is tied again on load.
"""
from __future__ import annotations

import argparse
import json
import shutil
import sys
from pathlib import Path


class ExportError(ValueError):
    """A checkpoint that cannot be exported; the message names the path and the problem."""


def export(checkpoint: str | Path, out_dir: str | Path, max_shard_size: str = "5GB") -> Path:
    """Write the HF model folder of ``checkpoint`` into ``out_dir``; return ``out_dir``."""
    from huggingface_hub import split_torch_state_dict_into_shards
    from safetensors import safe_open
    from safetensors.torch import save_file

    src = Path(checkpoint) / "hf"
    if not (Path(checkpoint) / "meta.json").is_file() or not src.is_dir():
        raise ExportError(f"{checkpoint} is not a complete hybridtrain checkpoint (no meta.json or hf/); "
                          "give a RUN_DIR/checkpoints/step_N folder")
    files = sorted(src.glob("model-stage*.safetensors"))
    if not files:
        raise ExportError(f"{src} holds no model-stage*.safetensors files")
    out = Path(out_dir)
    out.mkdir(parents=True, exist_ok=True)
    for old in out.glob("model*.safetensors*"):  # a previous export here must not mix with this one
        old.unlink()
    tensors = {}
    for f in files:
        with safe_open(str(f), framework="pt") as handle:
            for name in handle.keys():
                tensors[name] = handle.get_tensor(name)
    for f in src.iterdir():  # config, generation config, tokenizer
        if f.is_file() and not f.name.startswith("model-stage"):
            shutil.copy2(f, out / f.name)
    split = split_torch_state_dict_into_shards(tensors, filename_pattern="model{suffix}.safetensors",
                                               max_shard_size=max_shard_size)
    for filename, names in split.filename_to_tensors.items():
        save_file({n: tensors[n].contiguous() for n in names}, str(out / filename), metadata={"format": "pt"})
    if split.is_sharded:
        index = {"metadata": {"total_size": sum(t.numel() * t.element_size() for t in tensors.values())},
                 "weight_map": split.tensor_to_filename}
        (out / "model.safetensors.index.json").write_text(json.dumps(index, indent=2))
    return out


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m hybridtrain.export", description=__doc__.splitlines()[0])
    parser.add_argument("checkpoint", help="a RUN_DIR/checkpoints/step_N folder")
    parser.add_argument("out_dir", help="where to write the HF model folder")
    parser.add_argument("--max-shard-size", default="5GB", help="largest safetensors file (default 5GB)")
    args = parser.parse_args(argv)
    try:
        out = export(args.checkpoint, args.out_dir, args.max_shard_size)
    except ExportError as err:
        print(f"[hybridtrain] export error: {err}", file=sys.stderr)
        return 2
    print(f"[hybridtrain] exported {args.checkpoint} to {out}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
