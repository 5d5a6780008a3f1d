"""The rules of ``finetune.objective`` (``docs/preference.md``), checked by
:func:`~hybridtrain.plan.validate.build_plan` before anything is read or launched."""
from __future__ import annotations

from dataclasses import fields
from typing import Any

from hybridtrain.config.schema import Config
from hybridtrain.errors import PlanError
from hybridtrain.objectives import CPO_LOSS_TYPES, LOSS_TYPES
from hybridtrain.plan.data import has_validation


def _need(ok: bool, key: str, message: str) -> None:
    if not ok:
        raise PlanError(key, message)


PAIR_OBJECTIVES = ("dpo", "cpo", "orpo")
"""The objectives that train on ``data.format=preference`` pairs."""


def _changed(section: Any) -> list[str]:
    """The fields of a config dataclass that differ from its defaults."""
    default = type(section)()
    return [f.name for f in fields(section) if getattr(section, f.name) != getattr(default, f.name)]


def check_pair_rows(data: Any, objective: str) -> None:
    """What every objective over preference pairs needs of ``data`` beside ``data.format=preference``: a pair is one
    row of its two sequences (``data.packing`` null or ``documents``), and no validation records (not supported yet)."""
    packing = str(getattr(data.packing, "value", data.packing))
    _need(packing in ("None", "null", "documents", "True", "true"), "data.packing",
          f"{data.packing}: a preference pair is one row of its two sequences (documents), so data.packing must "
          "be null or documents")
    _need(not has_validation(data), "data.val_fraction" if data.val_fraction > 0 else
          ("data.val_path" if data.val_path else "data.val_split"),
          f"validation of finetune.objective={objective} is not supported yet; remove the validation records")


def check_objective(cfg: Config) -> None:
    """``finetune.objective`` against ``data.format`` and the ``finetune.dpo`` / ``cpo`` / ``orpo`` keys."""
    dpo, data = cfg.finetune.dpo, cfg.data
    objective = str(cfg.finetune.objective)
    preference = data.format == "preference"
    if objective == "reward":
        return  # hybridtrain/plan/reward.py
    if objective not in PAIR_OBJECTIVES:
        _need(not preference, "data.format", "preference pairs train only with finetune.objective=dpo, cpo, orpo or "
                                             "reward (a chosen and a rejected completion per prompt); set "
                                             "finetune.objective=dpo, or use data.format=prompt_completion to "
                                             "fine-tune on completions")
        return
    _need(preference, "finetune.objective", f"{objective} trains on preference pairs, but data.format={data.format}; "
                                            "set data.format=preference (records with prompt, chosen and rejected)")
    for other in PAIR_OBJECTIVES:  # another objective's keys would be ignored: refused instead
        changed = _changed(getattr(cfg.finetune, other)) if other != objective else []
        key = f"finetune.{other}.{changed[0] if changed else ''}"
        _need(not changed, key, f"is set, but finetune.objective={objective} does not read finetune.{other} (it "
                                f"belongs to finetune.objective={other}); remove it" +
              f" (finetune.{objective} takes {', '.join(f.name for f in fields(getattr(cfg.finetune, objective)))})")
    check_pair_rows(data, objective)
    if objective == "cpo":
        _check_cpo(cfg.finetune.cpo)
        return
    if objective == "orpo":
        _need(cfg.finetune.orpo.beta > 0, "finetune.orpo.beta", f"must be > 0, got {cfg.finetune.orpo.beta}")
        return
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


def _check_cpo(cpo: Any) -> None:
    """The ``finetune.cpo`` keys (TRL's ``CPOConfig``)."""
    _need(cpo.loss_type in CPO_LOSS_TYPES, "finetune.cpo.loss_type",
          f"{cpo.loss_type!r} is not a TRL CPO loss type; use one of {list(CPO_LOSS_TYPES)} (SimPO: simpo with "
          "finetune.cpo.cpo_alpha=0)")
    _need(cpo.beta > 0, "finetune.cpo.beta", f"must be > 0, got {cpo.beta}")
    _need(0 <= cpo.label_smoothing < 0.5, "finetune.cpo.label_smoothing",
          f"must be in [0, 0.5) (the share of flipped labels), got {cpo.label_smoothing}")
    _need(cpo.label_smoothing == 0 or cpo.loss_type in ("sigmoid", "simpo"), "finetune.cpo.label_smoothing",
          f"loss_type={cpo.loss_type} takes no label smoothing (TRL ignores it with a warning); set it to 0")
    _need(cpo.cpo_alpha >= 0, "finetune.cpo.cpo_alpha", f"must be >= 0 (the NLL term's weight), got {cpo.cpo_alpha}")
    _need(cpo.simpo_gamma == 0.5 or cpo.loss_type == "simpo", "finetune.cpo.simpo_gamma",
          f"is read only by loss_type=simpo, not {cpo.loss_type}; remove it or set finetune.cpo.loss_type=simpo")
