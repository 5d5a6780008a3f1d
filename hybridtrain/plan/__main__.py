"""``python -m hybridtrain.plan +recipe=NAME key=value ...``: the plan of a run, without running it.

Same Hydra config and overrides as training. Builds nothing but a meta model, starts no
process, reads no weights or data, so it answers in seconds for any model size: the rank map,
the stages, memory per rank, tokens per step, the bubble and warnings. With ``parallel=auto`` it
first searches the layouts and prints the choice with its runners-up.
"""
from __future__ import annotations

import sys

import hydra
from omegaconf import DictConfig

from hybridtrain.config import CONF_DIR, register_schema

register_schema()


def run(cfg: DictConfig) -> int:
    """Print the plan of one composed config; return the exit code (2: config error)."""
    from hybridtrain.config import to_config
    from hybridtrain.config.explain import message
    from hybridtrain.plan import PlanError, apply_pretrained_defaults, machine_facts, rank_budget, resolve
    from hybridtrain.plan.report import build_report, format_report

    try:
        typed = to_config(cfg)
    except Exception as err:  # noqa: BLE001 - OmegaConf validation errors
        print(f"[hybridtrain] config error: {message(err)}", file=sys.stderr)
        return 2
    apply_pretrained_defaults(typed)
    machine = machine_facts()
    try:
        plan, hf_config = resolve(typed, machine, announce=print)
    except PlanError as err:
        print(f"[hybridtrain] config error: {err}", file=sys.stderr)
        return 2
    budget = rank_budget(typed, plan, machine)
    print(format_report(build_report(typed, plan, hf_config, budget)), flush=True)
    if typed.finetune.method == "lora":  # the memory above counts gradients and optimizer state of the adapters only
        from hybridtrain.models.hf_model import meta_model
        from hybridtrain.plan.lora import describe

        print(f"[hybridtrain] {describe(typed, hf_config, meta_model(hf_config))}", flush=True)
    return 0


@hydra.main(version_base="1.3", config_path=str(CONF_DIR), config_name="config")
def _hydra_main(cfg: DictConfig) -> None:
    code = run(cfg)
    if code:
        sys.exit(code)


if __name__ == "__main__":
    from hybridtrain.versions import require_tested_versions

    require_tested_versions()
    # no run directory: the plan command writes nothing, so it neither checks nor locks one (the callback)
    given = {a.split("=", 1)[0].lstrip("+") for a in sys.argv[1:]}
    sys.argv += [a for a in ("hydra.output_subdir=null", "hydra/job_logging=disabled",
                             "hydra/hydra_logging=disabled", "hydra.run.dir=.", "~hydra.callbacks.output_dir")
                 if a.split("=", 1)[0] not in given]
    from hybridtrain.config.explain import run_hydra

    run_hydra(_hydra_main)
