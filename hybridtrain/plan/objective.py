"""The rules of ``finetune.objective`` (``docs/preference.md``), checked by
:func:`~hybridtrain.plan.validate.build_plan` before anything is read or launched."""
from __future__ import annotations

from hybridtrain.config.schema import Config
from hybridtrain.errors import PlanError
from hybridtrain.objectives import LOSS_TYPES
from hybridtrain.plan.data import has_validation


def _need(ok: bool, key: str, message: str) -> None:
    if not ok:
        raise PlanError(key, message)


def check_objective(cfg: Config) -> None:
    """``finetune.objective`` against ``data.format`` and the ``finetune.dpo`` keys."""
    dpo, data = cfg.finetune.dpo, cfg.data
    preference = data.format == "preference"
    if cfg.finetune.objective == "reward":
        return  # hybridtrain/plan/reward.py
    if cfg.finetune.objective != "dpo":
        _need(not preference, "data.format", "preference pairs train only with finetune.objective=dpo (a chosen "
                                             "and a rejected completion per prompt) or reward; set "
                                             "finetune.objective=dpo, or use data.format=prompt_completion to "
                                             "fine-tune on completions")
        return
    _need(preference, "finetune.objective", f"dpo trains on preference pairs, but data.format={data.format}; set "
                                            "data.format=preference (records with prompt, chosen and rejected)")
    packing = str(getattr(data.packing, "value", data.packing))
    _need(packing in ("None", "null", "documents", "True", "true"), "data.packing",
          f"{data.packing}: a preference pair is one row of its two sequences (documents), so data.packing must "
          "be null or documents")
    _need(not has_validation(data), "data.val_fraction" if data.val_fraction > 0 else
          ("data.val_path" if data.val_path else "data.val_split"),
          "validation of finetune.objective=dpo is not supported yet; remove the validation records")
    types = [str(t) for t in dpo.loss_type]
    unknown = [t for t in types if t not in LOSS_TYPES]
    _need(bool(types) and not unknown, "finetune.dpo.loss_type",
          f"{unknown or types} is not a list of TRL loss types; use some of {list(LOSS_TYPES)}")
    _need(len(set(types)) == len(types), "finetune.dpo.loss_type", f"{types} names a loss type twice")
    _need(dpo.loss_weights is None or len(dpo.loss_weights) == len(types), "finetune.dpo.loss_weights",
          f"{list(dpo.loss_weights or [])} has {len(dpo.loss_weights or [])} weights for the {len(types)} "
          f"loss types {types}; give one weight per loss type, or null for 1 each")
    _need(dpo.beta > 0, "finetune.dpo.beta", f"must be > 0, got {dpo.beta}")
    _need(0 <= dpo.label_smoothing < 0.5, "finetune.dpo.label_smoothing",
          f"must be in [0, 0.5) (the share of flipped labels; robust divides by 1 - 2 x it), got {dpo.label_smoothing}")
    _need("exo_pair" not in types or dpo.label_smoothing > 0, "finetune.dpo.label_smoothing",
          "exo_pair takes log(label_smoothing); set finetune.dpo.label_smoothing > 0 (TRL's papers use 1e-3)")
    _need(dpo.discopop_tau > 0, "finetune.dpo.discopop_tau", f"must be > 0, got {dpo.discopop_tau}")
