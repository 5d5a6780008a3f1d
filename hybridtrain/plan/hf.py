"""The HF model config of a run: the family's defaults with ``model.config`` overrides and the
tokenizer's vocabulary, or a ``model.pretrained`` folder's own config (checked); per-unit parameter
counts from the meta model."""
from __future__ import annotations

import difflib

from hybridtrain.config.schema import Config
from hybridtrain.errors import PlanError
from hybridtrain.models.families import FAMILIES, get_family
from hybridtrain.models.units import Kind, Unit, model_units

SHAPE_KEYS = ("vocab_size", "hidden_size", "n_embd", "intermediate_size", "n_inner", "num_hidden_layers", "n_layer",
              "num_attention_heads", "n_head", "num_key_value_heads", "head_dim", "max_position_embeddings",
              "n_positions", "tie_word_embeddings")
"""HF config keys that fix tensor shapes: a ``model.config`` override may not change them for a
pretrained model."""


def check_hf_overrides(model_type: str, overrides: dict) -> None:
    """Reject ``model.config`` keys the HF config class does not have (typos would be silently kept)."""
    from transformers import AutoConfig

    known = set(AutoConfig.for_model(model_type).to_dict())
    known |= {"tie_word_embeddings", "vocab_size", "n_inner", "head_dim", "attention_bias", "mlp_bias"}
    for key in overrides:
        if key not in known:
            close = difflib.get_close_matches(key, sorted(known), n=3)
            hint = f"; did you mean {close}?" if close else ""
            raise PlanError(f"model.config.{key}", f"{model_type} HF config has no field {key!r}{hint}")


def layer_params(cfg: Config, hf_config) -> list[int]:
    """Parameter count of each pipeline unit (from the meta model; no memory is allocated); a tied
    head counts the embedding's weight it reuses."""
    from hybridtrain.models.build import meta_model  # torch: only when counting

    family = get_family(cfg.model.model_type)
    model = meta_model(hf_config)

    def count(unit: Unit) -> int:
        path = family.embed if unit.kind is Kind.HEAD and unit.tied else unit.hf_path
        return sum(p.numel() for p in model.get_submodule(path).parameters())

    return [count(u) for u in model_units(family, hf_config)]


def pretrained_config(cfg: Config):
    """The HF config of the ``model.pretrained`` folder, checked: it exists, is an HF model of a
    supported family matching ``model.model_type``, and needs no remote code unless allowed."""
    from pathlib import Path

    from transformers import AutoConfig

    folder = Path(cfg.model.pretrained).expanduser()
    if not folder.is_dir():
        raise PlanError("model.pretrained", f"{cfg.model.pretrained!r} does not exist or is not a folder; "
                        "give the folder written by save_pretrained")
    if not (folder / "config.json").is_file():
        raise PlanError("model.pretrained", f"{folder} is not a HuggingFace model folder (no config.json); "
                        "give the folder written by save_pretrained")
    try:
        hf = AutoConfig.from_pretrained(str(folder), trust_remote_code=cfg.model.trust_remote_code)
    except ValueError as err:  # unknown model_type, or remote code refused
        raise PlanError("model.pretrained", f"{folder}: {err}".splitlines()[0] +
                        "; only built-in architectures load unless model.trust_remote_code=true") from None
    if hf.model_type not in FAMILIES:
        raise PlanError("model.pretrained", f"{folder} holds a {hf.model_type!r} model; supported architectures: "
                        f"{sorted(FAMILIES)}")
    if hf.model_type != cfg.model.model_type:
        raise PlanError("model.model_type", f"model.pretrained is a {hf.model_type!r} model but "
                        f"model.model_type={cfg.model.model_type!r}; use model={hf.model_type}")
    for key, value in cfg.model.config.items():  # overrides on top (dropout and the like)
        if key in SHAPE_KEYS and getattr(hf, key, None) != value:
            raise PlanError(f"model.config.{key}", f"{value} differs from the checkpoint's {getattr(hf, key, None)} "
                            f"in {folder}; a pretrained model's shape cannot change: drop the override")
        setattr(hf, key, value)
    hf._attn_implementation = cfg.model.attn_implementation
    hf.use_cache = False
    return hf


def apply_pretrained_defaults(cfg: Config) -> None:
    """With ``model.pretrained`` and no ``data.tokenizer``, use the model folder's tokenizer."""
    from pathlib import Path

    if cfg.model.pretrained and cfg.data.tokenizer is None:
        if (Path(cfg.model.pretrained).expanduser() / "tokenizer.json").is_file():
            cfg.data.tokenizer = str(Path(cfg.model.pretrained).expanduser().resolve())


def model_config(cfg: Config):
    """The HF config of this run: ``model.config`` overrides over the family defaults, with the
    tokenizer's vocabulary size and EOS id unless overridden. Launcher and workers both call this."""
    from hybridtrain.data.tokenizer import eos_id, vocab_size
    from hybridtrain.models.build import hf_config_of

    if cfg.model.model_type not in FAMILIES:
        raise PlanError("model.model_type", f"{cfg.model.model_type!r} is not supported; use one of {sorted(FAMILIES)}")
    check_hf_overrides(cfg.model.model_type, cfg.model.config)
    if cfg.model.pretrained:
        return pretrained_config(cfg)
    try:
        vocab, eos = vocab_size(cfg.data), eos_id(cfg.data)
    except FileNotFoundError as err:
        raise PlanError("data.tokenizer", str(err)) from None
    return hf_config_of(cfg.model.model_type, dict(cfg.model.config), vocab, cfg.model.attn_implementation, eos)
