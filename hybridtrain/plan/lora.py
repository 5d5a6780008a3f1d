"""The LoRA rules of a plan (``finetune``): hyperparameters, target modules, a ``finetune.lora.init_from``
adapter against the base model, and what DeepSpeed can train with a frozen base.

Runs in the controller before anything launches, on a meta model (no weights); reads only the
adapter's ``adapter_config.json`` and tensor shapes. Every violation is a :class:`PlanError`.
"""
from __future__ import annotations

from pathlib import Path
from typing import Callable, Optional

from hybridtrain.config.schema import Config
from hybridtrain.errors import PlanError
from hybridtrain.models.families import Family, family_of
from hybridtrain.models.lora import Adapter, AdapterError, LoraSpec, check_adapter, lora_spec, read_adapter
from hybridtrain.models.units import Kind, kind_of
from hybridtrain.plan.types import Plan

KEY = "finetune.lora"


def _need(ok: bool, key: str, message: str) -> None:
    if not ok:
        raise PlanError(key, message)


def in_out(family: Family, hf_config, hf_model) -> dict[str, tuple[int, int]]:
    """``(in, out)`` features of every module that can carry an adapter (HF path -> sizes)."""
    from hybridtrain.models.hf_model import linear_in_out

    out = {}
    for i in range(int(getattr(hf_config, family.n_layers))):
        for rel, rule in family.block_plan(hf_config, i).items():
            if rule.tp_style.lora:
                path = f"{family.blocks}.{i}.{rel}"
                try:
                    module = hf_model.get_submodule(path)
                except AttributeError:  # left out by this config (DeepSeek-V3's q_proj with a q_lora_rank)
                    continue
                out[path] = linear_in_out(module, rule.conv1d)
    return out


def check_lora(cfg: Config, hf_config, plan: Plan, hf_model=None) -> Optional[LoraSpec]:
    """Check ``cfg.finetune`` against the model and the plan; return the run's adapters (``None`` for
    full fine-tuning). With ``finetune.lora.init_from`` the adapter's ``r``, ``alpha``, ``rslora`` and
    targets are written into ``cfg.finetune.lora`` (so ``config.yaml`` records what trains)."""
    from hybridtrain.models.hf_model import meta_model

    ft = cfg.finetune
    if ft.method != "lora":
        _need(ft.lora.init_from is None, f"{KEY}.init_from", "starts LoRA adapters, but finetune.method="
              f"{ft.method}; set finetune.method=lora or drop finetune.lora.init_from")
        return None
    lo = ft.lora
    _need(lo.r >= 1, f"{KEY}.r", f"must be >= 1, got {lo.r}")
    _need(lo.alpha > 0, f"{KEY}.alpha", f"must be > 0, got {lo.alpha}")
    _need(0 <= lo.dropout < 1, f"{KEY}.dropout", f"must be in [0, 1), got {lo.dropout}")
    # 16-bit ZeRO-0 (DeepSpeed's separate optimizer) is refused for every run by plan/validate.py
    family = family_of(cfg.model)
    hf_model = hf_model if hf_model is not None else meta_model(hf_config)
    if lo.init_from:
        given = _adapter(cfg, family, hf_config, hf_model).spec(lo.dropout)
        lo.r, lo.alpha, lo.rslora, lo.target_modules = given.r, given.alpha, given.rslora, sorted(given.targets)
    try:
        spec = lora_spec(lo, family, hf_config, hf_model)
    except AdapterError as err:
        raise PlanError(f"{KEY}.target_modules", str(err)) from None
    _check_unverified(spec, family)
    _check_peft_renames(spec, family, hf_model)
    _check_stages(spec, family, plan)
    return spec


def _check_unverified(spec: LoraSpec, family: Family) -> None:
    """Refuse adapters on the modules the family has not proven LoRA on (``Family.unverified_lora``)."""
    for target in sorted(spec.targets):
        rel = target[len(family.blocks) + 1:].split(".", 1)[-1]  # model.layers.3.linear_attn.out_proj -> linear_attn...
        for path, why in family.unverified_lora.items():
            if rel == path or rel.startswith(f"{path}."):
                raise PlanError(f"{KEY}.target_modules", f"{KEY}.target_modules={spec_targets(spec)} adapts {target}: "
                                f"LoRA on a {family.model_type} block's {path} is not supported in this version ({why}); "
                                "list the other linear layers instead, e.g. "
                                f"finetune.lora.target_modules=[{','.join(_other_leaves(family, path))}]")


def _check_peft_renames(spec: LoraSpec, family: Family, hf_model) -> None:
    """Refuse targets that peft would move elsewhere when it loads the adapter. Under transformers 5, peft rewrites
    the ``target_modules`` of MoE model types whose experts transformers fuses (``PeftModel.from_pretrained`` calls
    ``peft.utils.transformers_weight_conversion.convert_peft_config_for_transformers``): a target ending in an old
    expert projection's name (``gate_proj``, ``up_proj``, ``down_proj``) can become LoRA on the fused experts, and
    which ones do depends on the peft release (0.21 moved DeepSeek-V3's dense MLP and shared experts there; 0.22
    keeps a target that names only ``nn.Linear`` modules). So the installed peft is asked: the run's targets
    (full module paths, as ``adapter_config.json`` lists them) go through that conversion on the meta model, and
    any it changes is refused. Without peft (or a peft without the conversion) the paths load as given."""
    try:
        from peft import LoraConfig
        from peft.utils.transformers_weight_conversion import convert_peft_config_for_transformers
    except ImportError:
        return
    targets = sorted(spec.targets)
    converted = LoraConfig(r=spec.r, lora_alpha=spec.alpha, target_modules=list(targets))
    convert_peft_config_for_transformers(converted, hf_model, None)
    moved = sorted(set(targets) - set(converted.target_modules or ()))
    if not moved:
        return
    import peft

    leaves = sorted({t.rsplit(".", 1)[-1] for t in targets} - {t.rsplit(".", 1)[-1] for t in moved})
    onto = sorted(set(converted.target_parameters or ()))
    names = sorted({t.rsplit(".", 1)[-1] for t in moved})
    raise PlanError(f"{KEY}.target_modules", f"peft {peft.__version__} maps the target names {names} of a "
                    f"{family.model_type} model "
                    f"onto its fused experts when it loads an adapter "
                    f"(under transformers 5: {onto[0] if onto else 'elsewhere'}), so an adapter on {moved[0]} and "
                    f"{len(moved) - 1} more such modules would not load as trained; adapt the others only, e.g. "
                    f"finetune.lora.target_modules=[{','.join(leaves)}]")


def _check_stages(spec: LoraSpec, family: Family, plan: Plan) -> None:
    """Every pipeline stage must hold an adapter: DeepSpeed cannot build an optimizer for a stage with
    nothing to train, nor run its backward."""
    adapted = {t.split(".")[len(family.blocks.split("."))] for t in spec.targets}  # block indices
    for s in range(plan.dims.pp):
        names = plan.stage_layers(s)
        if not any(kind_of(n) is Kind.BLOCK and n.split(".", 1)[1] in adapted for n in names):
            raise PlanError(f"{KEY}.target_modules", f"pipeline stage {s} ({', '.join(names)}) holds no adapted "
                            "module, and a stage with nothing to train cannot run; adapt a module in every stage's "
                            "blocks (e.g. all-linear) or move the stage boundaries (parallel.stage_layers)")


def _adapter(cfg: Config, family: Family, hf_config, hf_model) -> Adapter:
    """The ``finetune.lora.init_from`` adapter, checked against the base model: its base folder's config
    (when that folder is here), then every module and shape."""
    key = f"{KEY}.init_from"
    try:
        adapter = read_adapter(cfg.finetune.lora.init_from)
    except AdapterError as err:
        raise PlanError(key, str(err)) from None
    base = adapter.base_model
    folder = Path(base).expanduser() if base else None
    if folder is not None and (folder / "config.json").is_file():  # a local base: its config must be ours
        import json

        theirs = json.loads((folder / "config.json").read_text())
        if theirs.get("model_type") != hf_config.model_type:
            raise PlanError(key, f"{adapter.folder} was trained on {base}, a {theirs.get('model_type')!r} model, but "
                            f"this run's model is {hf_config.model_type!r}; give model.pretrained the adapter's base")
        for k in family.shape_keys():
            if k in theirs and theirs[k] != getattr(hf_config, k, None):
                raise PlanError(key, f"{adapter.folder} was trained on {base}, whose {k}={theirs[k]}, but this "
                                f"run's model has {k}={getattr(hf_config, k, None)}; give model.pretrained the "
                                "adapter's base model")
    try:
        check_adapter(adapter, family, int(getattr(hf_config, family.n_layers)), in_out(family, hf_config, hf_model))
    except AdapterError as err:
        raise PlanError(key, str(err)) from None
    return adapter


def trainable_params(spec: LoraSpec, sizes: dict[str, tuple[int, int]]) -> int:
    """Parameters the adapters add to the whole model (``r (in + out)`` per adapted module): peft's count."""
    return sum(spec.r * (sizes[t][0] + sizes[t][1]) for t in spec.targets)


def block_lora_sizes(spec: LoraSpec, family: Family, sizes: dict[str, tuple[int, int]], block: str,
                     tp: int, variant: Optional[str] = None) -> list[int]:
    """Element counts of the LoRA matrices one TP rank holds for block ``block`` (HF path) of ``variant``: a
    column-parallel module's ``A`` whole and ``B`` split, a row-parallel module's ``A`` split and ``B`` whole."""
    out = []
    plan = family.plan_of(variant)
    for rel in spec.in_block(block):
        n_in, n_out = sizes[f"{block}.{rel}"]
        out += plan[rel].tp_style.lora_numel(spec.r, n_in, n_out, tp)
    return out


def lora_memory(cfg: Config, hf_config, plan: Plan) -> Optional[Callable[[str], list[int]]]:
    """For the memory estimate: ``unit name -> element counts of the LoRA matrices one TP rank holds
    there`` (``block.N``; other units hold none), or ``None`` for full fine-tuning. ``cfg`` as checked by
    :func:`check_lora` (``config.yaml`` of a run)."""
    if cfg.finetune.method != "lora":
        return None
    from hybridtrain.models.hf_model import meta_model

    family = family_of(cfg.model)
    hf_model = meta_model(hf_config)
    spec = lora_spec(cfg.finetune.lora, family, hf_config, hf_model)
    sizes = in_out(family, hf_config, hf_model)

    def per_unit(name: str) -> list[int]:
        if kind_of(name) is not Kind.BLOCK:
            return []
        index = int(name.split(".", 1)[1])
        return block_lora_sizes(spec, family, sizes, f"{family.blocks}.{index}", plan.dims.tp,
                                family.variant_of(hf_config, index))

    return per_unit


def describe(cfg: Config, hf_config, hf_model) -> Optional[str]:
    """The start-up line of a LoRA run (``None`` for full fine-tuning): rank, scale, adapted modules and
    the trainable parameters against the model's, as peft's ``print_trainable_parameters`` counts them."""
    if cfg.finetune.method != "lora":
        return None
    family = family_of(cfg.model)
    spec = lora_spec(cfg.finetune.lora, family, hf_config, hf_model)
    trainable = trainable_params(spec, in_out(family, hf_config, hf_model))
    total = sum(p.numel() for p in hf_model.parameters()) + trainable
    leaves = sorted({t.rsplit(".", 1)[1] for t in spec.targets})
    scale = f"alpha/sqrt(r) = {spec.scaling:g}" if spec.rslora else f"alpha/r = {spec.scaling:g}"
    source = f", from {cfg.finetune.lora.init_from}" if cfg.finetune.lora.init_from else ""
    return (f"lora      r={spec.r}, {scale}, dropout {spec.dropout:g}, {len(spec.targets)} modules ({', '.join(leaves)})"
            f"{source}: {trainable:,} trainable parameters of {total:,} ({100 * trainable / total:.3f}%), the base frozen")


def spec_targets(spec: LoraSpec) -> str:
    """The distinct leaf names of ``spec``'s targets, as a user writes them (``[q_proj,v_proj]``)."""
    return "[" + ",".join(sorted({t.rsplit(".", 1)[-1] for t in spec.targets})) + "]"


def _other_leaves(family: Family, path: str) -> list[str]:
    """The LoRA-capable leaf names of ``family``'s blocks outside ``path``."""
    rules = family.all_rules()
    return list(dict.fromkeys(name.rsplit(".", 1)[-1] for name, rule in rules.items()
                              if rule.tp_style.lora and not (name == path or name.startswith(f"{path}."))))
