"""``python -m hybridtrain.extract_text SRC DST``: the language model of a published vision-language folder as a
causal-LM folder hybridtrain trains (Qwen3.5's ``Qwen3_5ForConditionalGeneration``, ``model_type`` ``qwen3_5``,
Qwen3.5-MoE's ``qwen3_5_moe``, and Gemma 3's ``Gemma3ForConditionalGeneration``, ``gemma3``: the 4B and larger).

Those folders keep the language model's weights under ``model.language_model.`` (Gemma 3's published files, written
before transformers 4.52: ``language_model.model.`` and ``language_model.lm_head.``, which transformers' own loading
renames the same way) beside the vision tower (``model.visual.``, ``vision_tower.``, ``multi_modal_projector.``)
and, in some releases, multi-token-prediction layers (``mtp.``, which transformers does not load); their
``config.json`` holds the language model's config as ``text_config``. ``DST`` gets that config as the causal-LM
class's of :data:`TEXT_MODELS`, the language model's tensors renamed to ``model.*`` (and ``lm_head.weight``), shard
by shard (one source shard in memory at a time), and the tokenizer and generation files.
The vision tower is not copied: a run trains the language model only, and ``SRC``'s vision tensors are unchanged for
whoever puts the trained language model back beside them. transformers' ``Qwen3_5ForCausalLM.from_pretrained`` of
``SRC`` itself would drop the vision tower the same way (``_keys_to_ignore_on_load_unexpected``), but hybridtrain
reads weights by name from the folder, so the plan refuses ``SRC`` and names this command.
"""
from __future__ import annotations

import argparse
import json
import shutil
import sys
from pathlib import Path

TEXT_MODELS = {"qwen3_5": "Qwen3_5ForCausalLM", "qwen3_5_moe": "Qwen3_5MoeForCausalLM", "gemma3": "Gemma3ForCausalLM"}
"""Conditional-generation ``model_type`` -> the causal-LM class of its language model."""
TEXT_TYPES = {"qwen3_5": "qwen3_5_text", "qwen3_5_moe": "qwen3_5_moe_text", "gemma3": "gemma3_text"}
"""Conditional-generation ``model_type`` -> its language model's ``model_type`` (where ``text_config`` omits it)."""
PREFIX = "model.language_model."
LEGACY_PREFIX = "language_model.model."
"""The language model's prefix in folders written before transformers 4.52 (the published Gemma 3 files; its head,
where stored, is ``language_model.lm_head.weight``)."""
COPIED = ("tokenizer.json", "tokenizer_config.json", "vocab.json", "merges.txt", "special_tokens_map.json",
          "added_tokens.json", "generation_config.json", "chat_template.jinja", "chat_template.json")
"""Files copied as they are (those present)."""


def command(folder: str | Path) -> str:
    """The command that extracts ``folder``'s language model (what the plan's refusal names)."""
    src = Path(str(folder))
    return f"python -m hybridtrain.extract_text {src} {src.with_name(src.name + '-text')}"


def text_name(name: str) -> str | None:
    """The causal-LM name of tensor ``name`` of the conditional model (``None``: not the language model's)."""
    for prefix in (PREFIX, LEGACY_PREFIX):
        if name.startswith(prefix):
            return "model." + name[len(prefix):]
    return "lm_head.weight" if name in ("lm_head.weight", "language_model.lm_head.weight") else None


def extract(src: Path, dst: Path) -> Path:
    """Write ``src``'s language model into ``dst`` (module docstring); returns ``dst``. ``ValueError`` for a folder
    that is not one of :data:`TEXT_MODELS`."""
    from safetensors import safe_open
    from safetensors.torch import save_file

    config = json.loads((src / "config.json").read_text())
    kind = config.get("model_type")
    if kind not in TEXT_MODELS:
        raise ValueError(f"{src} holds a {kind!r} model; this extracts the language model of {sorted(TEXT_MODELS)}")
    text = dict(config["text_config"])
    text["architectures"] = [TEXT_MODELS[kind]]
    if "tie_word_embeddings" in config:  # else the text config class's default (Gemma 3's: tied)
        text.setdefault("tie_word_embeddings", config["tie_word_embeddings"])
    text.setdefault("model_type", TEXT_TYPES[kind])
    for key in ("dtype", "torch_dtype", "transformers_version"):
        if key in config:
            text.setdefault(key, config[key])
    index = src / "model.safetensors.index.json"
    shards = sorted(set(json.loads(index.read_text())["weight_map"].values())) if index.is_file() else ["model.safetensors"]
    dst.mkdir(parents=True, exist_ok=True)
    weight_map: dict[str, str] = {}
    for shard in shards:
        with safe_open(str(src / shard), "pt") as f:
            tensors = {new: f.get_tensor(name) for name in f.keys() if (new := text_name(name)) is not None}
        if tensors:
            save_file(tensors, str(dst / shard), metadata={"format": "pt"})
            weight_map.update(dict.fromkeys(tensors, shard))
    if not weight_map:
        raise ValueError(f"{src} holds no tensor under {PREFIX!r} or {LEGACY_PREFIX!r}")
    if len(shards) > 1:
        (dst / "model.safetensors.index.json").write_text(json.dumps({"metadata": {}, "weight_map": weight_map},
                                                                     indent=2))
    (dst / "config.json").write_text(json.dumps(text, indent=2))
    for name in COPIED:
        if (src / name).is_file():
            shutil.copy2(src / name, dst / name)
    return dst


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m hybridtrain.extract_text", description=__doc__.splitlines()[0])
    parser.add_argument("src", type=Path, help="the published conditional-generation folder")
    parser.add_argument("dst", type=Path, help="the causal-LM folder to write (model.pretrained of the run)")
    args = parser.parse_args(argv)
    try:
        out = extract(args.src, args.dst)
    except (OSError, ValueError, KeyError) as err:
        print(f"[hybridtrain] extract_text: {err}", file=sys.stderr)
        return 2
    print(f"[hybridtrain] wrote {out} (train it with model.pretrained={out})")
    return 0


if __name__ == "__main__":
    sys.exit(main())
