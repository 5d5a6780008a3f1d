"""The HF model config of a run: the family's defaults with ``model.config`` overrides and the
tokenizer's vocabulary, or a ``model.pretrained`` folder's own config (checked); per-unit parameter
counts from the meta model."""
from __future__ import annotations

import difflib

from hybridtrain.config.schema import Config
from hybridtrain.errors import PlanError
from hybridtrain.models.families import FAMILIES, family_of
from hybridtrain.models.units import Kind, Unit, model_units

def check_hf_overrides(model_type: str, overrides: dict) -> None:
    """Reject ``model.config`` keys the HF config class does not have (typos would be silently kept)."""
    from transformers import AutoConfig

    defaults = AutoConfig.for_model(model_type)
    known = set(defaults.to_dict()) | set(getattr(defaults, "attribute_map", {}))  # aliases: Qwen3-MoE's num_experts
    known |= {"tie_word_embeddings", "vocab_size", "n_inner", "head_dim", "attention_bias", "mlp_bias"}
    for key in overrides:
        if key not in known:
            close = difflib.get_close_matches(key, sorted(known), n=3)
            hint = f"; did you mean {close}?" if close else ""
            raise PlanError(f"model.config.{key}", f"{model_type} HF config has no field {key!r}{hint}")


def layer_params(cfg: Config, hf_config) -> list[int]:
    """Parameter count of each pipeline unit (from the meta model; no memory is allocated); a tied
    head counts the embedding's weight it reuses."""
    from hybridtrain.models.hf_model import meta_model  # torch: only when counting

    family = family_of(cfg.model)
    model = meta_model(hf_config)

    def count(unit: Unit) -> int:
        path = family.embed if unit.kind is Kind.HEAD and unit.tied else unit.hf_path
        return sum(p.numel() for p in model.get_submodule(path).parameters())

    return [count(u) for u in model_units(family, hf_config)]


def pretrained_folder(cfg: Config):
    """The ``model.pretrained`` folder, checked to exist and to hold a ``config.json``."""
    from pathlib import Path

    folder = Path(cfg.model.pretrained).expanduser()
    if not folder.is_dir():
        what = "is a file, not a folder" if folder.is_file() else f"does not exist (working directory {Path.cwd()})"
        raise PlanError("model.pretrained", f"{cfg.model.pretrained!r} {what}; give the folder written by save_pretrained")
    if not (folder / "config.json").is_file():
        raise PlanError("model.pretrained", f"{folder} is not a HuggingFace model folder (no config.json); "
                        "give the folder written by save_pretrained")
    return folder


FLOAT_DTYPES = ("F64", "F32", "F16", "BF16", "F8_E4M3", "F8_E5M2")
"""safetensors dtypes the weights may be stored in (every one is read as fp32)."""


def check_pretrained_weights(cfg: Config, hf_config) -> None:
    """The ``model.pretrained`` folder's weights against the model its ``config.json`` describes, from
    the safetensors headers only (no tensor data is read): every file readable and as long as its
    header says, every parameter of the family's model there (under transformers' own names for old
    checkpoints) with its shape and a floating-point dtype. One :class:`PlanError` naming the first
    problems; a folder of pickles only (``pytorch_model.bin``) is refused with how to convert it."""
    from hybridtrain.models.hf_model import meta_model
    from hybridtrain.models.weights import CheckpointError, SafetensorsWeights, stored_names

    folder = pretrained_folder(cfg)
    try:
        headers = SafetensorsWeights(folder).headers()
    except CheckpointError as err:
        raise PlanError("model.pretrained", str(err)) from None
    family, model = family_of(cfg.model), meta_model(hf_config)
    stored = stored_names(headers, model)
    missing, wrong = [], []
    for name, param in model.named_parameters():  # a tied head shares the embedding's parameter: not listed
        key = stored.get(name, family.checkpoint_name(name))
        if key not in headers and _per_expert(name, family, headers):
            # fused experts stored per expert: the loader merges them (transformers' conversion), checking shapes;
            # every expert must be there (one missing made the merge stop short in a rank: probe n32)
            gap = _missing_expert(name, int(param.shape[0]), family, headers)
            if gap is not None:
                raise PlanError("model.pretrained", f"{folder} has no {gap}: its MoE layers are stored expert by "
                                f"expert and this one is missing (the others of {gap.split('.experts.')[0]} are "
                                "there); the folder is incomplete: re-save the model with save_pretrained")
            continue
        if key not in headers:
            missing.append(name)
        elif headers[key][0] != tuple(param.shape):
            wrong.append(f"{key} has shape {list(headers[key][0])} but the model expects {list(param.shape)}")
        elif headers[key][1] not in FLOAT_DTYPES:
            wrong.append(f"{key} is {headers[key][1]}, not floating point")
    if missing:
        _refuse_quantized(folder, hf_config, headers)
        more = f" and {len(missing) - 3} more" if len(missing) > 3 else ""
        raise PlanError("model.pretrained", f"{folder}: {len(missing)} of the {hf_config.model_type} model's tensors are "
                        f"missing from its safetensors files ({', '.join(missing[:3])}{more}; the files hold "
                        f"{len(headers)} tensors such as {sorted(headers)[:2]}); the weights do not belong to its "
                        "config.json: re-save the model with save_pretrained")
    if wrong:
        more = f" (and {len(wrong) - 2} more)" if len(wrong) > 2 else ""
        raise PlanError("model.pretrained", f"{folder}: {'; '.join(wrong[:2])}{more}; the weights do not match "
                        "its config.json: re-save the model with save_pretrained")


def _per_expert(name: str, family, headers) -> bool:
    """Whether the fused expert parameter ``name`` (``...experts.gate_up_proj`` / ``down_proj`` of a mixture-of-
    experts family) is stored as per-expert tensors (``...experts.0.*``, also under the family's legacy names,
    such as Mixtral's ``block_sparse_moe``), as ``save_pretrained`` and the published checkpoints write it."""
    if family.moe is None or ".experts." not in name:
        return False
    from hybridtrain.models.weights import checkpoint_renames

    prefix = name.rsplit(".experts.", 1)[0] + ".experts.0."
    prefixes = {prefix, *(prefix.replace(ours, theirs) for ours, theirs in checkpoint_renames(family.model_type))}
    return any(h.startswith(p) for h in headers for p in prefixes)


def _missing_expert(name: str, experts: int, family, headers) -> str | None:
    """The first per-expert tensor of the fused parameter ``name`` (``experts`` of them, its leading dimension) that
    the headers lack, or ``None``: every expert ``0 .. experts - 1`` must hold the tensors expert 0 holds, under the
    prefix (ours or the family's legacy one) the checkpoint uses."""
    from hybridtrain.models.weights import checkpoint_renames

    base = name.rsplit(".experts.", 1)[0] + ".experts."
    for stem in (base, *(base.replace(ours, theirs) for ours, theirs in checkpoint_renames(family.model_type))):
        first = f"{stem}0."
        leaves = sorted(h[len(first):] for h in headers if h.startswith(first))
        if leaves:
            return next((f"{stem}{e}.{leaf}" for e in range(experts) for leaf in leaves
                         if f"{stem}{e}.{leaf}" not in headers), None)
    return None


def _refuse_quantized(folder, hf_config, names=()) -> None:
    """A :class:`PlanError` for a quantised checkpoint (a ``quantization_config`` in its ``config.json``, or MXFP4
    tensors ``*_blocks`` / ``*_scales`` among ``names``, as the published gpt-oss checkpoints hold their experts):
    hybridtrain trains floating-point weights and does not dequantise, so it names the dequantised copy to write."""
    qc = getattr(hf_config, "quantization_config", None)
    if qc:
        method = qc.get("quant_method") if isinstance(qc, dict) else getattr(qc, "quant_method", None)
        what = f"quantization_config.quant_method={method}"
    else:
        odd = sorted(n for n in names if n.endswith(("_blocks", "_scales")))
        if not odd:
            return
        method, what = "mxfp4", f"MXFP4 tensors such as {odd[0]}"
    if str(method) == "mxfp4":
        how = ("dequantise it with transformers and save the float model: python -c \"import torch; from transformers "
               "import AutoModelForCausalLM, Mxfp4Config; AutoModelForCausalLM.from_pretrained('IN', "
               "quantization_config=Mxfp4Config(dequantize=True), dtype=torch.bfloat16).save_pretrained('OUT')\"")
    else:
        how = "load it with transformers' dequantisation and save_pretrained the floating-point model"
    raise PlanError("model.pretrained", f"{folder} is a quantised checkpoint ({what}); hybridtrain trains "
                    f"floating-point weights only and does not dequantise them: {how.replace('IN', str(folder))}, "
                    "then give model.pretrained=OUT")


def pretrained_config(cfg: Config):
    """The HF config of the ``model.pretrained`` folder, checked: it exists, is an HF model of a
    supported family matching ``model.model_type``, and needs no remote code unless allowed."""
    from pathlib import Path

    from transformers import AutoConfig

    folder = pretrained_folder(cfg)
    try:
        hf = AutoConfig.from_pretrained(str(folder), trust_remote_code=cfg.model.trust_remote_code)
    except ValueError as err:  # unknown model_type, or remote code refused
        raise PlanError("model.pretrained", f"{folder}: {err}".splitlines()[0] +
                        "; only built-in architectures load unless model.trust_remote_code=true") from None
    if hf.model_type not in FAMILIES and str(cfg.model.family or "") != "auto":
        raise PlanError("model.pretrained", f"{folder} holds a {hf.model_type!r} model; supported architectures: "
                        f"{sorted(FAMILIES)}; or model.family=auto to derive an adapter from transformers' plans "
                        "(checked on a tiny twin before training)")
    _refuse_quantized(folder, hf)
    if hf.model_type != cfg.model.model_type:
        raise PlanError("model.model_type", f"model.pretrained is a {hf.model_type!r} model but "
                        f"model.model_type={cfg.model.model_type!r}; use model={hf.model_type} (or +recipe=finetune, "
                        "which takes the family from the folder)")
    shape_keys = family_of(cfg.model).shape_keys()
    for key, value in cfg.model.config.items():  # overrides on top (dropout and the like)
        if key in shape_keys and getattr(hf, key, None) != value:
            raise PlanError(f"model.config.{key}", f"{value} differs from the checkpoint's {getattr(hf, key, None)} "
                            f"in {folder}; a pretrained model's shape cannot change: drop the override")
        setattr(hf, key, value)
    hf._attn_implementation = str(cfg.model.attn_implementation)
    hf.use_cache = False
    hf.dtype = "float32"  # every weight is read as fp32 (a bf16 folder's dtype would build bf16 norms, routers, sinks)
    return hf


def apply_pretrained_defaults(cfg: Config) -> None:
    """With ``model.pretrained``: no ``model.model_type`` means the folder's own (``config.json``), and
    no ``data.tokenizer`` means the folder's tokenizer."""
    import json
    from pathlib import Path

    if not cfg.model.pretrained:
        return
    folder = Path(cfg.model.pretrained).expanduser()
    if cfg.model.model_type is None and (folder / "config.json").is_file():
        try:
            cfg.model.model_type = json.loads((folder / "config.json").read_text()).get("model_type")
        except ValueError:
            pass  # pretrained_config reports the unreadable folder
    if cfg.data.tokenizer is None and (folder / "tokenizer.json").is_file():
        cfg.data.tokenizer = str(folder.resolve())


def checked_family(cfg: Config):
    """The run's family (:func:`~hybridtrain.models.families.family_of`), or a :class:`PlanError`: a
    ``model_type`` without a verified family (unless ``model.family=auto``), or one whose
    transformers plans cannot give an adapter."""
    from hybridtrain.extract_text import TEXT_MODELS, command

    if cfg.model.model_type in TEXT_MODELS and cfg.model.pretrained:  # a vision-language folder: its text model trains
        raise PlanError("model.pretrained", f"{cfg.model.pretrained} holds a {cfg.model.model_type!r} vision-language "
                        f"model; hybridtrain trains its language model ({TEXT_MODELS[cfg.model.model_type]}): extract "
                        f"it first with `{command(cfg.model.pretrained)}` and train that folder")
    if cfg.model.model_type not in FAMILIES and str(cfg.model.family or "") != "auto":
        raise PlanError("model.model_type", f"{cfg.model.model_type!r} is not supported; use one of {sorted(FAMILIES)}, "
                        "or model.family=auto to derive an adapter from transformers' plans (checked on a tiny twin "
                        "before training)")
    from hybridtrain.models.families.auto import NotDerivable

    try:
        return family_of(cfg.model)
    except NotDerivable as err:
        raise PlanError("model.family", f"auto: {cfg.model.model_type}: {err}; this architecture needs a verified "
                        "family (docs/families.md, adding a family)") from None
    except (KeyError, ValueError) as err:  # transformers does not know the model type
        raise PlanError("model.model_type", f"{cfg.model.model_type!r}: {err}") from None


def model_config(cfg: Config):
    """The HF config of this run: ``model.config`` overrides over the family defaults, with the
    tokenizer's vocabulary size and EOS id unless overridden, or the ``model.pretrained`` folder's.
    ``model.attn_implementation: null`` becomes the family's first kernel (sdpa where transformers
    supports it). A config transformers itself refuses is a :class:`PlanError` naming the
    ``model.config`` key. Launcher and workers both call this."""
    from hybridtrain.data.tokenizer import load_tokenizer
    from hybridtrain.models.hf_model import hf_config_of

    if cfg.model.model_type is None and cfg.model.pretrained:  # the folder's config.json gives it: why did it not?
        folder = pretrained_folder(cfg)
        raise PlanError("model.pretrained", f"{folder}/config.json names no model_type (or is not JSON); give the "
                        "folder written by save_pretrained")
    if cfg.model.model_type is None:
        raise PlanError("model.model_type", "null: the family comes from model.pretrained's config.json, but no "
                        f"model.pretrained is set; set model.pretrained=DIR or model=FAMILY ({sorted(FAMILIES)})")
    family = checked_family(cfg)
    if cfg.model.attn_implementation is None:
        cfg.model.attn_implementation = family.attn_implementations[0]
    if cfg.model.attn_implementation == "flash_attention_2":
        _check_flash_attention()
    check_hf_overrides(cfg.model.model_type, cfg.model.config)
    if cfg.model.pretrained:
        return pretrained_config(cfg)
    try:
        tokenizer = load_tokenizer(cfg.data)  # once: both numbers
        vocab, eos = len(tokenizer), tokenizer.eos_token_id
    except FileNotFoundError as err:
        raise PlanError("data.tokenizer", str(err)) from None
    try:
        hf = hf_config_of(cfg.model.model_type, dict(cfg.model.config), vocab, str(cfg.model.attn_implementation), eos)
        _check_builds(family, hf)
    except PlanError:  # the built blocks disagree with the family's block variants: says so itself
        raise
    except ValueError as err:  # transformers' own validation of the config or of the modules it builds
        raise _refused(cfg, err) from None
    return hf


def _check_flash_attention() -> None:
    """``flash_attention_2`` needs the ``flash-attn`` package here (transformers imports it to build
    the model); checked before anything is built so the error is one line, not an ImportError."""
    import importlib.util

    if importlib.util.find_spec("flash_attn") is None:
        raise PlanError("model.attn_implementation", "flash_attention_2 needs the flash-attn package (FlashAttention 2, "
                        "CUDA GPUs only), which is not installed; pip install flash-attn on a GPU machine, or use "
                        "model.attn_implementation=sdpa")


def _check_builds(family, hf_config) -> None:
    """Build the model on the meta device: transformers validates shapes there
    (GPT-2 refuses ``n_embd`` not divisible by ``n_head``), before anything is launched. A config
    built before is not built again (:mod:`hybridtrain.models.shapes` remembers its shapes)."""
    from hybridtrain.models.shapes import block_shapes

    if hf_config._attn_implementation in family.attn_implementations:  # else build_plan names the kernel
        block_shapes(family, hf_config)


def _refused(cfg: Config, err: Exception) -> PlanError:
    """A :class:`PlanError` for a config transformers refuses, naming the override it most likely
    concerns: the last given (command-line overrides come after the recipe's) whose value or name the
    message quotes."""
    import re

    message = str(err).splitlines()[0] if str(err) else type(err).__name__
    tokens = set(re.findall(r"[\w.]+", message))
    named = [k for k, v in cfg.model.config.items() if str(v) in tokens or k in tokens]
    key = f"model.config.{named[-1]}" if named else "model.config"
    overrides = ", ".join(f"{k}={v}" for k, v in cfg.model.config.items()) or "none"
    return PlanError(key, f"transformers refuses this {cfg.model.model_type} config: {message} "
                          f"(model.config overrides: {overrides}); change the override")
