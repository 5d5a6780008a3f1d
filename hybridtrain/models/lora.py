"""LoRA as data: which modules get adapters, the names peft gives their tensors, the adapter folder.

An adapter adds ``(alpha / r) B A dropout(x)`` to a linear layer's output, ``A`` ``[r, in]`` and ``B``
``[out, r]``, exactly as ``peft`` does (one ``A`` and one ``B`` over a fused projection's whole output).
Only the decoder blocks' linear layers can carry one (the family's column- and row-parallel modules:
every ``nn.Linear``/``Conv1D`` of a block); the embedding and the LM head never do.

Names: the parameter of module ``model.layers.0.self_attn.q_proj`` is ``model.layers.0.self_attn.q_proj.lora_A.weight``
inside hybridtrain (its HF name with peft's suffix) and ``base_model.model.model.layers.0.self_attn.q_proj.lora_A.weight``
in peft's ``adapter_model.safetensors``. The layers are in :mod:`hybridtrain.parallel.lora`, building them in
:mod:`hybridtrain.models.build`. Imports neither torch nor deepspeed.
"""
from __future__ import annotations

import json
import math
import re
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Iterable, Mapping, Optional, Sequence

ALL_LINEAR = "all-linear"
"""peft's shorthand for every linear layer but the output layer."""
PEFT_PREFIX = "base_model.model."
"""What peft's ``PeftModel`` puts before an HF module path (``get_peft_model_state_dict`` keeps it)."""
ADAPTER_WEIGHTS = "adapter_model.safetensors"
ADAPTER_CONFIG = "adapter_config.json"
LORA_A, LORA_B = "lora_A", "lora_B"


class AdapterError(ValueError):
    """A LoRA target or adapter folder that does not fit the model; the message names what and why."""


@dataclass(frozen=True)
class LoraSpec:
    """The adapters of a run: hyperparameters and the HF paths of the adapted modules."""

    r: int
    alpha: float
    dropout: float
    rslora: bool
    targets: frozenset
    """HF module paths that get an adapter (``model.layers.3.mlp.down_proj``)."""

    @property
    def scaling(self) -> float:
        """peft's ``scaling``: ``alpha / r``, or ``alpha / sqrt(r)`` with rsLoRA."""
        return self.alpha / (math.sqrt(self.r) if self.rslora else self.r)

    def in_block(self, prefix: str) -> list[str]:
        """Block-relative names of the adapted modules of block ``prefix`` (``model.layers.3``), sorted."""
        return sorted(t[len(prefix) + 1:] for t in self.targets if t.startswith(prefix + "."))


def is_lora(name: str) -> bool:
    """Whether parameter ``name`` (local or HF) is a LoRA matrix."""
    return f".{LORA_A}." in f".{name}" or f".{LORA_B}." in f".{name}"


def peft_name(hf_name: str) -> str:
    """``model.layers.0.self_attn.q_proj.lora_A.weight`` -> peft's ``base_model.model.model.layers...``."""
    return PEFT_PREFIX + hf_name


def hf_name_of(name: str) -> str:
    """The inverse of :func:`peft_name`; also drops peft's adapter name (``lora_A.default.weight``)."""
    name = name[len(PEFT_PREFIX):] if name.startswith(PEFT_PREFIX) else name
    return re.sub(rf"\.({LORA_A}|{LORA_B})\.[^.]+\.weight$", r".\1.weight", name)


def lora_modules(family: Any, num_layers: int, variants: Optional[Sequence[str]] = None) -> list[str]:
    """HF paths of every module that can carry an adapter: the column- and row-parallel linear layers of
    every decoder block (by its variant's plan, ``variants``: each block's; ``None``: all alike), in block order."""
    out = []
    for i in range(num_layers):
        plan = family.plan_of(variants[i] if variants is not None else None)
        out += [f"{family.blocks}.{i}.{rel}" for rel, rule in plan.items() if rule.tp_style.lora]
    return out


def _matches(target_modules: Any, key: str) -> bool:
    """peft's ``check_target_module_exists``: a string is a regular expression that must match the
    whole path; a list entry matches the path itself or its ending ``.ENTRY``."""
    if isinstance(target_modules, str):
        return re.fullmatch(target_modules, key) is not None
    return any(key == t or key.endswith(f".{t}") for t in target_modules)


def resolve_targets(family: Any, num_layers: int, module_names: Iterable[str], target_modules: Any,
                    variants: Optional[Sequence[str]] = None) -> frozenset:
    """HF paths of the modules ``target_modules`` selects, as peft would on the same HF model.

    ``module_names`` are every module path of the model. ``all-linear`` is every block linear layer (the
    LM head is peft's excluded output layer). An entry that matches nothing, or that matches a module
    that cannot carry an adapter here (the LM head, an embedding, a norm), is an :class:`AdapterError`
    naming the modules the family has.
    """
    names = list(module_names)
    present = set(names)
    allowed = [a for a in lora_modules(family, num_layers, variants) if a in present]  # what this config builds
    leaves = list(dict.fromkeys(a.rsplit(".", 1)[1] for a in allowed))  # q_proj, k_proj, ... in plan order
    have = f"the linear layers of a {family.model_type} block are {', '.join(leaves)} (or use all-linear)"
    if isinstance(target_modules, str) and target_modules.lower() == ALL_LINEAR:
        return frozenset(allowed)
    if isinstance(target_modules, str):
        entries = [target_modules]
    else:
        entries = [str(t) for t in (target_modules or [])]
        if not entries:
            raise AdapterError(f"no target modules given; {have}")
        if any(t.lower() == ALL_LINEAR for t in entries):
            raise AdapterError(f"{ALL_LINEAR} must be given alone (finetune.lora.target_modules={ALL_LINEAR}), not "
                               f"in a list: {entries}")
    allowed_set = set(allowed)
    chosen: set[str] = set()
    for entry in entries:
        pattern = entry if isinstance(target_modules, str) else [entry]
        try:
            hits = [n for n in names if _matches(pattern, n)]
        except re.error as err:
            raise AdapterError(f"{entry!r} is not a regular expression ({err}); {have}") from None
        if not hits:
            raise AdapterError(f"{entry!r} matches no module of the {family.model_type} model; {have}")
        other = [n for n in hits if n not in allowed_set]
        if other:
            raise AdapterError(f"{entry!r} matches {other[0]}, which is not a linear layer of a decoder block (LoRA "
                               f"here adapts those only; never the embedding, the LM head or a norm); {have}")
        chosen.update(hits)
    return frozenset(chosen)


def lora_spec(lora_cfg: Any, family: Any, hf_config: Any, hf_model: Any) -> LoraSpec:
    """The :class:`LoraSpec` of ``finetune.lora`` for this model: ``target_modules`` resolved as peft
    resolves them on the same HF model (``hf_model``, meta is enough); raises
    :class:`AdapterError`."""
    layers = int(getattr(hf_config, family.n_layers))
    from hybridtrain.models.units import block_variants

    targets = resolve_targets(family, layers, (n for n, _ in hf_model.named_modules()), lora_cfg.target_modules,
                              block_variants(family, hf_config))
    return LoraSpec(r=int(lora_cfg.r), alpha=float(lora_cfg.alpha), dropout=float(lora_cfg.dropout),
                    rslora=bool(lora_cfg.rslora), targets=targets)


def adapter_config(spec: LoraSpec, conv1d: bool, base_model: Optional[str]) -> dict:
    """peft's ``adapter_config.json`` for ``spec`` (``LoraConfig`` field names).

    Written by hand rather than with ``peft.LoraConfig.save_pretrained`` so that training and export do
    not need peft installed; the fields are ones every peft release since 0.8 reads. ``target_modules``
    lists the full module paths, so peft adapts exactly these modules whatever its own matching rules.
    ``conv1d``: the family's linear layers are HF ``Conv1D`` (GPT-2), which peft runs with ``fan_in_fan_out``.
    """
    alpha = int(spec.alpha) if float(spec.alpha).is_integer() else spec.alpha
    return {"peft_type": "LORA", "task_type": "CAUSAL_LM", "base_model_name_or_path": base_model,
            "r": spec.r, "lora_alpha": alpha, "lora_dropout": spec.dropout, "use_rslora": spec.rslora,
            "target_modules": sorted(spec.targets), "fan_in_fan_out": conv1d, "bias": "none",
            "init_lora_weights": True, "modules_to_save": None, "inference_mode": True}


@dataclass(frozen=True)
class Adapter:
    """A peft LoRA adapter folder, read (tensor shapes only, not the values)."""

    folder: Path
    config: dict
    shapes: dict
    """HF-style name (``model.layers.0.self_attn.q_proj.lora_A.weight``) -> shape."""

    @property
    def targets(self) -> frozenset:
        return frozenset(n.rsplit(".", 2)[0] for n in self.shapes)

    @property
    def r(self) -> int:
        return int(next(s for n, s in self.shapes.items() if n.endswith(f"{LORA_A}.weight"))[0])

    @property
    def base_model(self) -> Optional[str]:
        return self.config.get("base_model_name_or_path")

    def spec(self, dropout: float) -> LoraSpec:
        """The adapter's hyperparameters and targets, with ``dropout`` (a training choice)."""
        return LoraSpec(r=self.r, alpha=float(self.config.get("lora_alpha", 8)), dropout=dropout,
                        rslora=bool(self.config.get("use_rslora", False)), targets=self.targets)


UNSUPPORTED = {"use_dora": "DoRA", "lora_bias": "a bias on lora_B", "modules_to_save": "modules_to_save",
               "rank_pattern": "per-module ranks (rank_pattern)", "alpha_pattern": "per-module alphas (alpha_pattern)",
               "target_parameters": "target_parameters", "layer_replication": "layer_replication"}
"""``adapter_config.json`` fields whose non-empty value asks for what hybridtrain's LoRA does not do."""


def read_adapter(folder: str | Path) -> Adapter:
    """Read a peft adapter folder's config and tensor shapes; :class:`AdapterError` naming the file and the
    problem when it is not a plain LoRA adapter in safetensors."""
    folder = Path(folder).expanduser()
    cfg_file, weights = folder / ADAPTER_CONFIG, folder / ADAPTER_WEIGHTS
    if not cfg_file.is_file() or not weights.is_file():
        raise AdapterError(f"{folder} is not a peft adapter folder (it needs {ADAPTER_CONFIG} and {ADAPTER_WEIGHTS}; "
                           "save the adapter with PeftModel.save_pretrained, which writes safetensors)")
    try:
        config = json.loads(cfg_file.read_text())
    except ValueError as err:
        raise AdapterError(f"{cfg_file} is not valid JSON: {err}") from None
    if config.get("peft_type") != "LORA":
        raise AdapterError(f"{cfg_file} holds a {config.get('peft_type')!r} adapter; only LoRA adapters load")
    for key, what in UNSUPPORTED.items():
        if config.get(key):
            raise AdapterError(f"{cfg_file} asks for {what} ({key}={config[key]!r}), which hybridtrain's LoRA does not do")
    from safetensors import safe_open

    try:
        with safe_open(str(weights), framework="pt") as f:
            shapes = {hf_name_of(n): tuple(f.get_slice(n).get_shape()) for n in f.keys()}
    except Exception as err:  # noqa: BLE001 - safetensors raises its own error types
        raise AdapterError(f"{weights} is not a readable safetensors file ({err})") from None
    odd = [n for n in shapes if not re.search(rf"\.({LORA_A}|{LORA_B})\.weight$", n)]
    if odd:
        raise AdapterError(f"{weights} holds {odd[0]!r}, which is not a LoRA A or B matrix of a linear layer")
    if not shapes:
        raise AdapterError(f"{weights} holds no tensors")
    return Adapter(folder=folder, config=config, shapes=shapes)


def check_adapter(adapter: Adapter, family: Any, num_layers: int, in_out: Mapping[str, tuple[int, int]]) -> None:
    """Refuse an adapter made for another base model: a module this model lacks or cannot adapt, or A and B
    shapes that do not fit the module's ``(in, out)`` features (``in_out``: HF path -> sizes, of every module
    that can carry an adapter)."""
    allowed = set(in_out)
    for target in sorted(adapter.targets):
        if target not in allowed:
            raise AdapterError(f"{adapter.folder} adapts {target}, which this {family.model_type} model "
                               f"({num_layers} blocks) does not have as a block linear layer; the adapter was "
                               "made for another base model")
        a = adapter.shapes.get(f"{target}.{LORA_A}.weight")
        b = adapter.shapes.get(f"{target}.{LORA_B}.weight")
        if a is None or b is None:
            raise AdapterError(f"{adapter.folder}: {target} has only one of {LORA_A} and {LORA_B}")
        n_in, n_out = in_out[target]
        if a != (adapter.r, n_in) or b != (n_out, adapter.r):
            raise AdapterError(f"{adapter.folder}: {target} has {LORA_A} {a} and {LORA_B} {b} but this model's "
                               f"{target} has {n_in} inputs and {n_out} outputs (expected {(adapter.r, n_in)} and "
                               f"{(n_out, adapter.r)}); the adapter was made for another base model")
